"""RollPacker (§6): tail batching, reward scheduling and the stream trainer against veRL."""
from __future__ import annotations

from sim.repro.core import Paper, Row, Setting
from sim.repro.figures import metric, round_figures, speedup

# RollPacker §6: veRL baseline colocated on 16/32/64 H800 for Qwen2.5-7B/8k, 14B/16k, 32B/32k (rollout TP 1/2/2,
# trainer on every GPU), P0 = 128, R0 = 8, multi-task; five rounds = one tail-batching period (4 short + 1 long).
# The stream trainer's repurposing of rollout GPUs is not modelled (colocated train calls pause every engine).
def RK(model: str) -> Setting:
    gpus, tp, cap = {"7b": (16, 1, "8k"), "14b": (32, 2, "16k"), "32b": (64, 2, "32k")}[model]
    return Setting(f"rollpacker_{model}_{cap}", f"h800_{model}", gpus // tp, gpus, 128, 8, 5, colocated=True)


TAIL_ONLY = (("handoff", (("name", "whole_round"),)), ("update", (("name", "step_publish"),)))
ROLLPACKER = [
    Row("veRL rollout+reward share of step, 14B/16k (Table 1)", (0.77, 0.79), "77–79%",
        metric(("sync", RK("14b")), lambda r: round_figures(r)["pre_train_share"])),
    Row("veRL training share of step, 14B/16k (Table 1)", (0.21, 0.23), "21–23%",
        metric(("sync", RK("14b")), lambda r: round_figures(r)["train_share"])),
    *[Row(f"E2E speedup vs veRL, {m} (§6.1)", (x, x), f"{x:.2f}x",
          speedup(("rollpacker", RK(m)), ("sync", RK(m))), "{:.2f}x")
      for m, x in (("7b", 2.03), ("14b", 2.22), ("32b", 2.56))],
    *[Row(f"tail batching alone vs veRL, {m} (Table 2)", (x, x), f"{x:.2f}x",
          speedup(("rollpacker", RK(m), TAIL_ONLY), ("sync", RK(m))), "{:.2f}x")
      for m, x in (("7b", 1.30), ("14b", 1.48), ("32b", 2.21))],
]

PAPER = Paper(ROLLPACKER)

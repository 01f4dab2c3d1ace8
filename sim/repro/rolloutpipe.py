"""RolloutPipe (§5): complete-group pipelining (CGP) and frontier-group dispatch (FGD) against Slime."""
from __future__ import annotations

from typing import Callable

from sim.repro.core import Paper, Row, Runs, Setting
from sim.repro.figures import metric, round_figures

# RolloutPipe §5.1: Qwen3-1.7B; rollout = one SGLang engine on 2 x A100 40GB (TP=2); trainer = 8 x RTX 4090;
# K = 8; R in {32, 64, 96}; "over four rounds". Slime = our sync preset; CGP = the rolloutpipe preset with FIFO
# dispatch instead of FGD.
def RP(R: int) -> Setting:
    return Setting("rolloutpipe", "rolloutpipe_qwen3_1p7b", 1, 8, R, 8, 4)


CGP_ONLY = (("dispatch", (("name", "fifo"),)),)


def main_time_cut(R: int) -> Callable[[Runs], float | None]:
    return lambda runs: (None if runs.get("rolloutpipe", RP(R)) is None else
                         1 - round_figures(runs.get("rolloutpipe", RP(R)))["step_s"]
                         / round_figures(runs.get("sync", RP(R)))["step_s"])


def cgp_share(runs: Runs) -> float | None:
    full, cgp = runs.get("rolloutpipe", RP(96)), runs.get("rolloutpipe", RP(96), CGP_ONLY)
    slime = runs.get("sync", RP(96))
    if full is None or cgp is None:
        return None
    t = {k: round_figures(v)["step_s"] for k, v in (("full", full), ("cgp", cgp), ("slime", slime))}
    return (t["slime"] - t["cgp"]) / (t["slime"] - t["full"])


ROLLOUTPIPE = [
    *[Row(f"Slime trainer waiting ratio, R={R} (§2.1/§5.3)", (0.47, 0.52), "47–52%",
          metric(("sync", RP(R)), lambda r: r.metrics["trainer_wait_ratio"])) for R in (32, 64, 96)],
    Row("Slime first legal dispatch, R=96 (§5.2)", (509, 543), "509–543 s",
        metric(("sync", RP(96)), lambda r: round_figures(r)["first_dispatch_s"]), "{:.0f} s"),
    Row("CGP+FGD main-time cut vs Slime, R=32 (§5.2)", (0.307, 0.329), "30.7–32.9%", main_time_cut(32)),
    Row("CGP+FGD main-time cut vs Slime, R=96 (§5.2)", (0.398, 0.423), "39.8–42.3%", main_time_cut(96)),
    Row("CGP+FGD trainer waiting ratio, R=96 (§5.3)", (0.138, 0.150), "13.8–15.0%",
        metric(("rolloutpipe", RP(96)), lambda r: r.metrics["trainer_wait_ratio"])),
    Row("CGP first legal dispatch, R=96 (§5.2)", (46, 90), "46–90 s",
        metric(("rolloutpipe", RP(96), CGP_ONLY), lambda r: round_figures(r)["first_dispatch_s"]), "{:.0f} s"),
    Row("CGP+FGD first legal dispatch, R=96 (§5.2)", (52, 61), "52–61 s",
        metric(("rolloutpipe", RP(96)), lambda r: round_figures(r)["first_dispatch_s"]), "{:.0f} s"),
    Row("CGP share of the reduction, R=96 (§5.2)", (0.92, 0.96), "92–96%", cgp_share),
]



PAPER = Paper(ROLLOUTPIPE)

"""RolloutPipe (§5): complete-group pipelining (CGP) and frontier-group dispatch (FGD) against Slime.

Setting (§5.1): Qwen3-1.7B; rollout = one SGLang engine on 2 x A100 40GB PCIe (TP = 2); trainer = 8 x RTX 4090,
its speed calibrated from Table 1 (sim/profiles.py `rolloutpipe_qwen3_1p7b`; Table 1 is not a reproduced row);
K = 8, B = 16, so U = F_w = 2; R in {32, 64, 96}; "over four rounds". The three systems, as presets:
    Slime    `slime`: FIFO admission, the barrier, then R / U optimizer steps of U groups, one publication
    CGP      `rolloutpipe` with FIFO admission (`CGP_ONLY`): groups go to the trainer U at a time as they materialise
    CGP+FGD  `rolloutpipe`: CGP plus the frontier (at most F_w groups in service on the engine, §3.3's hard cap)
Not simulated: the Feasible Batch Selector's per-GPU token budget (the trainer's micro-batching: timing-neutral
here), SGLang's and Megatron's internals beyond the cost model, the weight publication's real cost (assumed).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import sched
from sim.profiles import get_profile
from sim.repro.core import Paper, Row, Runs, Setting
from sim.repro.figures import mean_batch, metric, round_figures
from sim.run import simulate
from sim.workload import get_workload


def RP(R: int) -> Setting:
    return Setting("rolloutpipe", "rolloutpipe_qwen3_1p7b", 1, 8, R, 8, 4)


CGP_ONLY = (("dispatch", (("name", "fifo"),)),)
SLIME = "slime"
COMPONENTS = ("simulated: one engine (TP 2, A100-40GB PCIe roofline: continuous batching, paged KV, preemption), "
              "the trainer (Table 1 speed), exact-match reward (20 ms median), weight publication (assumed 100 Gb/s "
              "+ 1 s) and load; Slime = `slime` preset, CGP = `rolloutpipe` with FIFO admission, CGP+FGD = "
              "`rolloutpipe`. Not simulated: the token-budget batch selector (timing-neutral), SGLang's scheduler "
              "beyond FIFO continuous batching.")


def step_s(runs: Runs, preset: str, R: int, overrides: tuple = ()) -> float | None:
    r = runs.get(preset, RP(R), overrides)
    return None if r is None else round_figures(r)["step_s"]


def main_time_cut(R: int, overrides: tuple = ()) -> Callable[[Runs], float | None]:
    """1 - main time (round start -> its last train call's end) of RolloutPipe / Slime's."""
    def f(runs: Runs) -> float | None:
        new, base = step_s(runs, "rolloutpipe", R, overrides), step_s(runs, SLIME, R)
        return None if new is None or base is None else 1 - new / base
    return f


def fgd_over_cgp(R: int) -> Callable[[Runs], float | None]:
    """§5.2's "CGP+FGD further reduces the main time by X% over CGP": 1 - T(CGP+FGD) / T(CGP)."""
    def f(runs: Runs) -> float | None:
        full, cgp = step_s(runs, "rolloutpipe", R), step_s(runs, "rolloutpipe", R, CGP_ONLY)
        return None if full is None or cgp is None else 1 - full / cgp
    return f


def cgp_share(R: int) -> Callable[[Runs], float | None]:
    """§5.2's "CGP accounts for X% of the reduction": (T_Slime - T_CGP) / (T_Slime - T_CGP+FGD)."""
    def f(runs: Runs) -> float | None:
        full, cgp, slime = step_s(runs, "rolloutpipe", R), step_s(runs, "rolloutpipe", R, CGP_ONLY), step_s(
            runs, SLIME, R)
        return None if None in (full, cgp, slime) else (slime - cgp) / (slime - full)
    return f


FGD = "CGP+FGD (F_w = 2) vs Slime"
ROWS = [
    *[Row(f"Slime trainer waiting ratio, R={R} (§2.1/§5.3)", (0.47, 0.52), "47–52%",
          metric((SLIME, RP(R)), lambda r: r.metrics["trainer_wait_ratio"]), setting="Slime")
      for R in (32, 64, 96)],
    Row("Slime first legal dispatch, R=96 (§5.2)", (509, 543), "509–543 s",
        metric((SLIME, RP(96)), lambda r: round_figures(r)["first_dispatch_s"]), "{:.0f} s", setting="Slime"),
    Row("CGP+FGD main-time cut vs Slime, R=32 (§5.2)", (0.307, 0.329), "30.7–32.9%", main_time_cut(32), setting=FGD),
    Row("CGP+FGD main-time cut vs Slime, R=96 (§5.2)", (0.398, 0.423), "39.8–42.3%", main_time_cut(96), setting=FGD),
    Row("CGP+FGD further cut over CGP alone, R=96 (§5.2)", (0.025, 0.114), "2.5–11.4%", fgd_over_cgp(96),
        setting="CGP+FGD vs CGP"),
    Row("CGP+FGD trainer waiting ratio, R=96 (§5.3)", (0.138, 0.150), "13.8–15.0%",
        metric(("rolloutpipe", RP(96)), lambda r: r.metrics["trainer_wait_ratio"]), setting="CGP+FGD"),
    Row("CGP first legal dispatch, R=96 (§5.2)", (46, 90), "46–90 s",
        metric(("rolloutpipe", RP(96), CGP_ONLY), lambda r: round_figures(r)["first_dispatch_s"]), "{:.0f} s",
        setting="CGP (FIFO admission)"),
    Row("CGP+FGD first legal dispatch, R=96 (§5.2)", (52, 61), "52–61 s",
        metric(("rolloutpipe", RP(96)), lambda r: round_figures(r)["first_dispatch_s"]), "{:.0f} s",
        setting="CGP+FGD"),
    Row("CGP share of the reduction, R=32 (§5.2)", (0.71, 0.79), "71–79%", cgp_share(32),
        setting="Slime, CGP, CGP+FGD"),
    Row("CGP share of the reduction, R=96 (§5.2)", (0.92, 0.96), "92–96%", cgp_share(96),
        setting="Slime, CGP, CGP+FGD"),
]


# -------------------------------------------------------------------------------- what the FGD misses depend on
def fgd_sensitivity(runs: Runs) -> str:
    """The FGD misses' sensitivity (sim/repro/rolloutpipe.md, "Misses"): the frontier width, the per-step overhead
    k4 and the within-group dispersion, on R = 96 (seed of `runs`); each cut is 1 - main time / Slime's main time."""
    slime = step_s(runs, SLIME, 96)
    cut = lambda t: f"{1 - t / slime:+.1%}"  # noqa: E731
    widths = []
    for w in (2, 4, 8, 16):
        t = step_s(runs, "rolloutpipe", 96, (("dispatch", (("width", w),)),))
        widths.append(f"F_w={w} {t:.0f} s ({cut(t)})")
    cgp = step_s(runs, "rolloutpipe", 96, CGP_ONLY)
    s = RP(96)
    fgd, fifo = runs.get("rolloutpipe", s), runs.get("rolloutpipe", s, CGP_ONLY)
    no_k4 = replace(get_profile(s.cost), k4=0.0)
    tight = replace(get_workload(s.workload, runs.seed), sigma_sample=0.0)   # every sample at its prompt's length

    def alt(cost=s.cost, workload=s.workload) -> float:
        r = simulate(sched.load_preset("rolloutpipe"), workload, cost, 1, 8, steps=10**9, group_size=8,
                     prompts_per_step=96, seed=runs.seed, samples=4 * 96 * 8)
        return round_figures(r)["step_s"]
    t_k4, t_tight = alt(cost=no_k4), alt(workload=tight)
    return (f"FGD sensitivity, R=96, seed {runs.seed} (Slime {slime:.0f} s, CGP {cgp:.0f} s = {cut(cgp)}): "
            f"{'; '.join(widths)}. Mean sequences per decode step: FGD {mean_batch(fgd):.1f} of F_w x K = 16, "
            f"FIFO {mean_batch(fifo):.1f}. FGD with no per-step overhead (k4 = 0): {t_k4:.0f} s ({cut(t_k4)}); "
            f"FGD with no within-group dispersion (sigma_sample = 0): {t_tight:.0f} s ({cut(t_tight)}).")


PAPER = Paper(ROWS, components=COMPONENTS, notes=[fgd_sensitivity])

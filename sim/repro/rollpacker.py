"""RollPacker (§6): tail batching, the reward scheduler and the stream trainer against veRL.

Setting (§6): Qwen2.5-7B/8k, 14B/16k, 32B/32k on 16 / 32 / 64 H800 (rollout TP 1 / 2 / 2), P0 = 128, R0 = 8, the
uniform math / code / judge mix (one task per prompt), five rounds = one tail-batching period (4 short + 1 long).
The systems, as the simulator runs them (Table 2's cumulative rows):
    veRL          `sync`, colocated; rewards in a separate, synchronous stage after the round's rollout
    +Tail Batch.  `rollpacker` with round-end training (TAIL_ONLY) and veRL's synchronous reward stage
    +Reward       the same with RollPacker's reward scheduler: asynchronous per-sample scoring and the adaptive
                  sandbox timeout (§4.3)
    +Trainer      `rollpacker` as shipped: the parallelism planner (§4.2) and the stream trainer's elastic scale-down
                  (§4.4) on top = RollPacker
Both reward modes use the same scorer pool, REWARD_WORKERS per GPU (assumption: the paper gives no pool size; veRL's
reward stage and RollPacker's ray.remote workers run on the GPU nodes' CPUs). Not simulated: the judge's MPS
colocation and layer-wise offload (§4.3), RLHFuse. The planner runs in RollPacker (Table 2's +Parallelism row,
0-1.5% there, is not isolated from +Trainer) and in Fig. 12a's length ramp (a note: one seed; its runs are the
slowest here).
Training speed: calibrated from Table 1 (profiles.py ROLLPACKER_TRAIN_MFU), so Table 1's shares are not rows.
"""
from __future__ import annotations

import statistics
from typing import Callable

import sched
from sim.profiles import ROLLPACKER_CALIBRATION_SHARE, ROLLPACKER_TRAIN_MFU, at_tp, get_profile
from sim.repro.core import SPEEDUP, Paper, Row, Runs, Setting, sim_kwargs
from sim.repro.figures import round_figures, round_rollout, speedup, throughput
from sim.run import SimResult, simulate
from sim.workload import RampedWorkload, get_workload

REWARD_WORKERS = 16  # scorers per GPU (assumption, module docstring)
MODELS = {"7b": (16, 1, "8k"), "14b": (32, 2, "16k"), "32b": (64, 2, "32k")}


def RK(model: str, system: str = "rollpacker") -> Setting:
    """The paper's setting for `model`, with the reward mode of `system` ("verl": the synchronous stage; "tail":
    tail batching with it; "rollpacker": asynchronous scoring with the adaptive timeout)."""
    gpus, tp, cap = MODELS[model]
    sim = (("reward_workers", REWARD_WORKERS * gpus),)
    if system in ("verl", "tail"):
        sim += (("reward_stage", True),)
    else:
        sim += (("adaptive_timeout", True),)
    return Setting(f"rollpacker_{model}_{cap}", f"h800_{model}", gpus // tp, gpus, 128, 8, 5, colocated=True, sim=sim)


ROUND_END = (("handoff", (("name", "whole_round"),)), ("update", (("name", "step_publish"),)),
             ("rebalance", (("name", "tail_abort"),)))


def elastic(model: str) -> tuple:
    """The shipped preset with the engines' KV pool (what vLLM reports at start-up) for the scale-down's check."""
    return (("rebalance", (("kv_tokens", get_profile(f"h800_{model}").kv_capacity_tokens),)),)


def system(name: str, model: str) -> tuple:
    """(preset, setting, overrides) of one of Table 2's systems."""
    return {"verl": ("sync", RK(model, "verl")),
            "tail": ("rollpacker", RK(model, "tail"), ROUND_END),
            "reward": ("rollpacker", RK(model), ROUND_END),
            "rollpacker": ("rollpacker", RK(model), elastic(model))}[name]


def gain(name: str, model: str, base: str = "verl", fn: Callable[[SimResult], float] = throughput):
    return speedup(system(name, model), system(base, model), fn)


# ---------------------------------------------------------------------------------------------- §6.3: the etas
def eta_setting(model: str) -> Setting:
    """§6.3's rollout-only comparison: asynchronous scoring, round-end training (rollout time does not depend on
    either)."""
    return RK(model)


def eta_run(eta_p: float, eta_r: float) -> tuple:
    if eta_p == eta_r == 1.0:
        return ("sync", eta_setting("32b"))
    return ("rollpacker", eta_setting("32b"), ROUND_END + (
        ("dispatch", (("eta_prompts", eta_p), ("eta_responses", eta_r))),))


def rollout_speedup(new: tuple, base: tuple) -> Callable[[Runs], float | None]:
    """Period-averaged rollout speed of `new` over `base`: mean rollout time per round (round start -> its last kept
    response finished) of base / of new (§6.3: "the average iteration time of a full period")."""
    return speedup(new, base, lambda r: 1 / statistics.fmean(round_rollout(r).values()))


def slower(a: tuple, b: tuple) -> Callable[[Runs], float | None]:
    """1 when a's mean rollout time exceeds b's, else 0."""
    def f(runs: Runs) -> float | None:
        x, y = runs.get(*a), runs.get(*b)
        return None if x is None or y is None else float(
            statistics.fmean(round_rollout(x).values()) > statistics.fmean(round_rollout(y).values()))
    return f


def short_round_ratio(fn: Callable[[SimResult, str], float], model: str) -> Callable[[Runs], float | None]:
    """veRL's per-round figure over RollPacker's short rounds' (means over rounds)."""
    def f(runs: Runs) -> float | None:
        base, new = runs.get(*system("verl", model)), runs.get(*system("rollpacker", model))
        return None if base is None or new is None else fn(base, "normal") / fn(new, "short")
    return f


def mean_rollout(r: SimResult, kind: str) -> float:
    kinds = round_kinds(r)
    return statistics.fmean(t for rd, t in round_rollout(r).items() if kinds[rd] == kind)


def mean_max_len(r: SimResult, kind: str) -> float:
    kinds = round_kinds(r)
    return statistics.fmean(n for rd, n in round_max_len(r).items() if kinds[rd] == kind)


def round_kinds(r: SimResult) -> dict[int, str]:
    return {e.data["round"]: e.data.get("kind", "normal") for e in r.events if e.kind == "round_started"}


def round_max_len(r: SimResult) -> dict[int, int]:
    """Per round, the longest response trained."""
    g_round = {e.group_id: e.data["round"] for e in r.events if e.kind == "group_materialized"}
    trained = {g for e in r.events if e.kind == "train_started" for g in e.data["groups"]}
    kept = {e.req_id for e in r.events if e.kind == "reward_scored" and e.group_id in trained}
    dropped = {e.req_id for e in r.events if e.kind == "trajectory_aborted"}
    out: dict[int, int] = {}
    for e in r.events:
        if e.kind == "trajectory_finished" and e.req_id in kept and e.req_id not in dropped:
            rd = g_round[e.group_id]
            out[rd] = max(out.get(rd, 0), e.data["tokens"])
    return out


def reward_share(r: SimResult) -> float:
    """veRL's reward stage over its step: per round, last response finished -> last group materialised, over round
    start -> the round's train call's end (Table 1's reward column)."""
    starts = {e.data["round"]: e.t for e in r.events if e.kind == "round_started"}
    rollout = round_rollout(r)
    mat: dict[int, float] = {}
    for e in r.events:
        if e.kind == "group_materialized":
            mat[e.data["round"]] = e.t
    step = round_figures(r)["step_s"]
    return statistics.fmean(mat[rd] - (starts[rd] + rollout[rd]) for rd in rollout) / step


ROWS = [
    *[Row(f"E2E speedup vs veRL, {m} (§6.1)", (x, x), f"{x:.2f}x", gain("rollpacker", m), "{:.2f}x", SPEEDUP,
          "RollPacker: tail batching + async reward + adaptive timeout + planner + elastic stream trainer")
      for m, x in (("7b", 2.03), ("14b", 2.22), ("32b", 2.56))],
    *[Row(f"+Tail Batching vs veRL, {m} (Table 2)", (x, x), f"{x:.2f}x", gain("tail", m), "{:.2f}x", SPEEDUP,
          "tail batching, round-end training, veRL's reward stage")
      for m, x in (("7b", 1.30), ("14b", 1.48), ("32b", 2.21))],
    *[Row(f"+Reward vs veRL, {m} (Table 2)", (x, x), f"{x:.2f}x", gain("reward", m), "{:.2f}x", SPEEDUP,
          "+ async reward + adaptive timeout, round-end training")
      for m, x in (("7b", 2.01), ("14b", 1.99), ("32b", 2.48))],
    Row("short-round max response length, veRL / RollPacker, 14B (§3 Fig. 4a: up to 8.9x)", (1.0, 8.9), "<= 8.9x",
        short_round_ratio(mean_max_len, "14b"), "{:.1f}x", SPEEDUP, "per-round longest trained response"),
    Row("short-round rollout time, veRL / RollPacker, 32B (§6.2 Fig. 10b: up to 7.8x)", (1.0, 7.8), "<= 7.8x",
        short_round_ratio(mean_rollout, "32b"), "{:.1f}x", SPEEDUP, "round start -> its last kept response"),
    Row("tail batching rollout speed vs none, 32B, eta = 1.25 (§6.3: up to 3.9x)", (1.0, 3.9), "<= 3.9x",
        rollout_speedup(eta_run(1.25, 1.25), eta_run(1.0, 1.0)), "{:.2f}x", SPEEDUP, "period-averaged rollout time"),
    Row("combined vs fixed-P0 (eta_R = 1.25 alone), 32B (§6.3: up to 1.5x)", (1.0, 1.5), "<= 1.5x",
        rollout_speedup(eta_run(1.25, 1.25), eta_run(1.0, 1.25)), "{:.2f}x", SPEEDUP, "period-averaged rollout time"),
    Row("combined vs fixed-R0 (eta_P = 1.25 alone), 32B (§6.3: up to 1.6x)", (1.0, 1.6), "<= 1.6x",
        rollout_speedup(eta_run(1.25, 1.25), eta_run(1.25, 1.0)), "{:.2f}x", SPEEDUP, "period-averaged rollout time"),
    Row("fixed-R0 at 32k: rollout time up from eta_P 1.25 to 1.5 (§6.3; 1 = yes)", (1, 1), "yes",
        slower(eta_run(1.5, 1.0), eta_run(1.25, 1.0)), "{:.0f}", setting="period-averaged rollout time"),
]


def reward_note(runs: Runs) -> str:
    """veRL's reward stage in the mix (context for REWARD_WORKERS, not a row: Table 1 reports single-task runs)."""
    r = runs.get(*system("verl", "14b"))
    return (f"veRL 14B/16k reward stage, seed {runs.seed}: {reward_share(r):.1%} of the step with "
            f"{REWARD_WORKERS} scorers per GPU (Table 1, single-task runs: math 5%, code 13%, judge 7%; in the mix "
            f"every round ends on a code run hanging to the 30 s limit).")


def eta_table(runs: Runs) -> str:
    """§6.3's trend at 32B/32k (seed of `runs`): the period-averaged rollout time per (eta_P, eta_R)."""
    cells = []
    for ep, er in ((1.0, 1.0), (1.0, 1.25), (1.0, 1.5), (1.25, 1.0), (1.5, 1.0), (1.25, 1.25), (1.5, 1.5)):
        r = runs.get(*eta_run(ep, er))
        cells.append(f"({ep:g}, {er:g}) {statistics.fmean(round_rollout(r).values()):.0f} s")
    return f"§6.3 eta trend, 32B/32k, seed {runs.seed}, mean rollout time per round by (eta_P, eta_R): " + \
        "; ".join(cells) + "."


def stream_trainer_note(runs: Runs) -> str:
    """Table 2's +Trainer step and Table 3's scale-down, per model: RollPacker with / without the stream trainer."""
    parts = []
    for m in MODELS:
        full, base = runs.get(*system("rollpacker", m)), runs.get(*system("reward", m))
        parts.append(f"{m} {throughput(full) / throughput(base):.2f}x (lent-engine GPU-seconds "
                     f"{full.backend.lent_gpu_s:.0f}, kills by the adaptive timeout {full.metrics['reward_killed']})")
    return (f"+Trainer over +Reward (Table 2: 1.01x / 1.10x / 1.02x from its rows), seed {runs.seed}: "
            + "; ".join(parts) + ".")


# ------------------------------------------------------------------------ §6.4 Fig. 12a: the parallelism planner
RAMP_STEPS = 12


def planner_run(runs: Runs, planner: bool) -> SimResult:
    """Fig. 12a's setting: 14B on 16 GPUs, engines from TP 1, P0 = 128, R0 = 8, the response lengths ramping so the
    cap goes 8k -> 32k over 12 steps (the caption's 2k per step; the text says 1k). The 32k length distribution is
    rollpacker_32b_32k's (assumption: the paper's ramp data are not described), scaled from 1/4 to 1 over the prompts
    that 12 short rounds draw (ceil(1.25 P0) each). RollPacker as shipped (async reward, adaptive timeout, stream
    trainer) with the planner on or off (TP stays 1)."""
    def go() -> SimResult:
        s = RK("14b")
        w = RampedWorkload(get_workload("rollpacker_32b_32k"), 0.25, 1.0, RAMP_STEPS * 160)
        c = at_tp(get_profile("h800_14b"), 1)
        over = {"rebalance": {"kv_tokens": c.kv_capacity_tokens, "planner": planner}}
        return simulate(sched.load_preset("rollpacker", over), w, c, 16, 16, steps=RAMP_STEPS, group_size=8,
                        prompts_per_step=128, seed=runs.seed, colocated=True, **sim_kwargs(s))
    return runs.memo(("fig12a", planner), go)


def planner_note(runs: Runs) -> str:
    """Fig. 12a: the TP by step, the preemptions by step and round kind, and the rollout time against a fixed TP 1;
    and what the planner did in the E2E runs."""
    on, off = planner_run(runs, True), planner_run(runs, False)
    hist = on.policy.rebalance.planner.history
    ups = [i + 1 for i, (_, _, _, tp) in enumerate(hist) if tp > (hist[i - 1][3] if i else 1)]
    pre = " ".join(f"{k[0]}{n}" for _, k, n, _ in hist)
    gain = statistics.fmean(round_rollout(off).values()) / statistics.fmean(round_rollout(on).values())
    e2e = "; ".join(f"{m} TP " + "/".join(str(h[3]) for h in runs.get(*system("rollpacker", m)).policy.rebalance
                                          .planner.history) for m in MODELS)
    return (f"Fig. 12a planner, 14B on 16 GPUs from TP 1, cap 8k -> 32k over {RAMP_STEPS} steps, seed {runs.seed}: "
            f"preemptions by step (s short, l long) {pre}; TP raised after steps {ups or 'none'} to "
            f"{[hist[i - 1][3] for i in ups]} (paper: steps 3 and 8, to 2 and 4); mean rollout time, fixed TP 1 / "
            f"planner: {gain:.2f}x (paper: 1.9x). TP after each step in the E2E runs: {e2e}.")


def calibrate_train_mfu(seeds: tuple[int, ...] = (0, 1, 2)) -> float:
    """The training MFU that gives the simulated veRL 14B/16k step Table 1's training share (22%, the mean of its
    math / code / judge rows): in veRL's synchronous colocated step, rollout and reward do not depend on the
    training speed, so one run fixes it. The value is recorded in sim/profiles.py (ROLLPACKER_TRAIN_MFU); a test
    recomputes it."""
    prof = get_profile("h800_14b")
    s = RK("14b", "verl")
    mfus = []
    for seed in seeds:
        r = simulate(sched.load_preset("sync"), s.workload, prof, s.num_engines, s.train_gpus, steps=10**9,
                     group_size=s.group_size, prompts_per_step=s.prompts, seed=seed, colocated=True,
                     samples=s.rounds * s.prompts * s.group_size, **dict(s.sim))
        f = round_figures(r)
        want = ROLLPACKER_CALIBRATION_SHARE / (1 - ROLLPACKER_CALIBRATION_SHARE) * (1 - f["train_share"])
        mfus.append(ROLLPACKER_TRAIN_MFU * f["train_share"] / want)
    return statistics.fmean(mfus)


COMPONENTS = ("simulated: colocated engines (H800 roofline: continuous batching, paged KV, preemption), the "
              "trainer (speed calibrated from Table 1), weight resharding, the multi-task reward (one task per prompt; "
              f"{REWARD_WORKERS} scorer per GPU; veRL: a synchronous stage after the rollout; RollPacker: "
              "asynchronous, adaptive sandbox timeout), tail batching, the parallelism planner (TP resharded between "
              "steps on preemptions), the stream trainer's elastic scale-down. Not simulated: the judge's MPS "
              "colocation and layer-wise offload, RLHFuse.")
PAPER = Paper(ROWS, components=COMPONENTS, notes=[reward_note, stream_trainer_note, eta_table, planner_note])

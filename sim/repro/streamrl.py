"""StreamRL (§7): disaggregated stream generation and skewness-aware dispatch against its like-for-like baseline.

Setting (§7): H800 cluster, PPO with a global batch of 1024 (one sample per prompt), the 20K dataset (its length
distribution is Fig. 7 only: sim/workload.py `streamrl_20k`, the longest of a round at the 20K cap and the tail
chosen by Fig. 11's balanced start, a test). Throughput is the paper's
(§7 Metrics: samples per second over the iterations after warm-up): 3 iterations here, the first the warm-up.
The systems, as presets on the same engines and trainer:
    ColocationRL  `sync`, colocated on every GPU ("shares the same inference and training backend implementations
                  as StreamRL", §7.1; verl differs from it by framework optimisations the simulator does not have, so
                  the paper's verl ranges are not rows)
    StreamRL      `streamrl` / `streamrl_async` on the GPU split Algorithm 1 picks from the simulated generation
                  profile and the cost model's training time (sim/split.py; the GPUs it leaves go to training)
GPU counts: 32 for 7B (Fig. 11's "32 GPUs"); 64 for 72B (Table 3 and Fig. 10 give none: assumption). TP 1 / 8
(assumption, sim/profiles.py). Cross-datacenter (§7.3, Fig. 12): the SGS on H20 engines, the trainer on the
single-datacenter run's H800 GPUs, one cost profile for both (`h20_h800_streamrl_7b`). Not simulated: the
network-aware broadcast trees (§6), an LLM ranker: a simulated prompt has no text, so the ranker is the true
length with a log-normal error whose recall of each round's longest 20% is Table 4's 0.87 (its Qwen2.5-7B ranker;
§7.2 "up to 87%"; sim/ranker.py); it reads nothing of the workload generator's latent difficulty.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Callable

import sched
from sched.policies.streamrl.resource_split import split_cross_dc
from sim.profiles import BYTES_PER_PARAM, QWEN25_72B, get_profile
from sim.repro.core import ARITHMETIC, LEVEL, SPEEDUP, Paper, Row, Runs, Setting
from sim.repro.figures import after_warmup_throughput
from sim.cost import CostModel
from sim.ranker import NoisyRanker, install, recall_at
from sim.run import SimResult, simulate
from sim.split import GenProfile, plan, profile
from sim.workload import RampedWorkload, get_workload

# Generation profiles step by an 8-GPU node (the paper's unit: Fig. 11 adds "one node with 8 GPUs"; TP groups stay
# inside a node), which keeps each profile to a few simulations.
ROUNDS, STEP = 3, {"7b": 8, "72b": 8}
MODELS = {"7b": (32, "h800_streamrl_7b"), "72b": (64, "h800_streamrl_72b")}
RANKER_RECALL = 0.87      # Table 4: the Qwen2.5-7B ranker's recall of the longest 20% (§7.2: "up to 87%")
RANKER = (("ranker_recall", RANKER_RECALL),)   # simulate()'s argument: every skewness-aware run ranks with it


def gen_profile(runs: Runs, model: str, workload: str = "streamrl_20k") -> GenProfile:
    gpus, cost = MODELS[model]
    return runs.memo(("gen-profile", model, workload), lambda: profile(
        "streamrl", workload, cost, gpus, 1024, 1, runs.seed, STEP[model], RANKER_RECALL))


def split_of(runs: Runs, model: str) -> tuple[int, int]:
    """Algorithm 1's (generation GPUs, training GPUs) for the model's GPUs; leftover GPUs go to training."""
    gpus, cost = MODELS[model]
    s = plan(gen_profile(runs, model), cost, gpus)
    return s.gen, gpus - s.gen


def colocated(model: str, ranker: bool = False) -> Setting:
    """ColocationRL's setting; `ranker`: with the simulated ranker (for its skewness-aware variant)."""
    gpus, cost = MODELS[model]
    return Setting("streamrl_20k", cost, gpus // get_profile(cost).gpus_per_engine, gpus, 1024, 1, ROUNDS, True,
                   RANKER if ranker else ())


def disaggregated(model: str, gen: int, train: int) -> Setting:
    _, cost = MODELS[model]
    return Setting("streamrl_20k", cost, gen // get_profile(cost).gpus_per_engine, train, 1024, 1, ROUNDS,
                   sim=RANKER)


def run(runs: Runs, preset: str, model: str, split: str = "alg1", overrides: tuple = ()) -> SimResult | None:
    """A disaggregated StreamRL run on Algorithm 1's split ("alg1") or an even one ("even")."""
    gpus, _ = MODELS[model]
    gen, train = split_of(runs, model) if split == "alg1" else (gpus // 2, gpus - gpus // 2)
    return runs.get(preset, disaggregated(model, gen, train), overrides)


def vs_colocation(preset: str | None, model: str, overrides: tuple = ()) -> Callable[[Runs], float | None]:
    """Throughput after warm-up over ColocationRL's; preset None: ColocationRL with the skewness-aware dispatch."""
    def f(runs: Runs) -> float | None:
        base = runs.get("sync", colocated(model))
        new = (runs.get("sync", colocated(model, ranker=True), SKEW_COLOCATED) if preset is None
               else run(runs, preset, model, overrides=overrides))
        return None if base is None or new is None else after_warmup_throughput(new) / after_warmup_throughput(base)
    return f


SKEW_COLOCATED = (("dispatch", (("name", "skewness"),)),)


def alg1_over_even(runs: Runs) -> float | None:
    a, b = run(runs, "streamrl_async", "72b"), run(runs, "streamrl_async", "72b", "even")
    return None if a is None or b is None else after_warmup_throughput(a) / after_warmup_throughput(b)


def step_gain(num: Callable[[Runs], float | None], den: Callable[[Runs], float | None]
              ) -> Callable[[Runs], float | None]:
    """One step of a cumulative table: the ratio of two of its cumulative rows (Table 3's per-step gain)."""
    def f(runs: Runs) -> float | None:
        a, b = num(runs), den(runs)
        return None if a is None or b is None else a / b
    return f


# ------------------------------------------------------------------------------------ Fig. 9: random, ranker, oracle
def generation_s(runs: Runs, how: str, model: str, cost: CostModel | None = None) -> float:
    """Round 1's generation time (round start -> its last response) on the model's Algorithm 1 generation engines,
    20K, with random (FIFO by count), ranker (skewness, Table 4's ranker) or oracle (skewness, true lengths)
    dispatch; `cost` replaces the model's cost profile (a sensitivity)."""
    _, name = MODELS[model]
    c = cost or get_profile(name)

    def go() -> float:
        preset = sched.load_preset("sync" if how == "random" else "streamrl")
        if how == "oracle":
            install(preset, NoisyRanker(get_workload("streamrl_20k", runs.seed), 0.0))
        engines = split_of(runs, model)[0] // c.gpus_per_engine
        r = simulate(preset, "streamrl_20k", c, engines, 10**4, steps=2, group_size=1, prompts_per_step=1024,
                     seed=runs.seed, ranker_recall=RANKER_RECALL if how == "ranker" else None)
        start = {e.data["round"]: e.t for e in r.events if e.kind == "round_started"}
        g_round = {e.group_id: e.data["round"] for e in r.events if e.kind == "group_materialized"}
        return max(e.t for e in r.events if e.kind == "trajectory_finished" and g_round.get(e.group_id) == 1) - start[1]
    return runs.memo(("fig9", how, model, cost is not None), go)


def ranker_share(model: str) -> Callable[[Runs], float]:
    """The share of the oracle's generation-time gain over random dispatch that the ranker gets."""
    def f(runs: Runs) -> float:
        rnd, rk, orc = (generation_s(runs, h, model) for h in ("random", "ranker", "oracle"))
        return (rnd - rk) / (rnd - orc)
    return f


def fig9_order(model: str) -> Callable[[Runs], float]:
    def f(runs: Runs) -> float:
        rnd, rk, orc = (generation_s(runs, h, model) for h in ("random", "ranker", "oracle"))
        return float(orc <= rk * 1.001 and rk < rnd)
    return f


def fig9_note(runs: Runs) -> str:
    """Fig. 9 per model, and with the decode step's KV-read term removed (Eq. 1's context-free latency)."""
    parts = []
    for m in MODELS:
        times = [generation_s(runs, h, m) for h in ("random", "ranker", "oracle")]
        flat = replace(get_profile(MODELS[m][1]), k1=0.0)
        no_kv = [generation_s(runs, h, m, flat) for h in ("random", "ranker", "oracle")]
        parts.append(f"{m} {split_of(runs, m)[0]} GPUs: " + " / ".join(f"{t:.0f}" for t in times)
                     + " s (no KV-read term: " + " / ".join(f"{t:.0f}" for t in no_kv) + " s)")
    return f"Fig. 9 generation time random / ranker / oracle, seed {runs.seed}: " + "; ".join(parts) + "."


# ----------------------------------------------------------------------------------- Fig. 11: dynamic scale-out
SCALE_ITERS, SCALE_SPARE, SCALE_UNIT = 20, 32, 8


def scale_out_run(runs: Runs) -> SimResult:
    """StreamRL-Async on 32 GPUs for 7B while lengths ramp from the 10K to the 20K dataset over 20 iterations
    (assumption: Fig. 11 gives no iteration count), the split from Algorithm 1 on the 10K workload, an 8-GPU node
    at a time from 32 spare GPUs, delta' from the generation profile over 8..56 GPUs (a node at a time)."""
    def go() -> SimResult:
        prof = profile("streamrl", "streamrl_10k", "h800_streamrl_7b", 32 + SCALE_SPARE, 1024, 1, runs.seed,
                       SCALE_UNIT, RANKER_RECALL)
        s = plan(GenProfile(prof.gpus_per_engine, {x: t for x, t in prof.seconds.items() if x < 32},
                            prof.round_tokens), "h800_streamrl_7b", 32)
        xs = sorted(prof.seconds)
        over = {"rebalance": {"unit": SCALE_UNIT, "max_engines": s.gen + SCALE_SPARE, "gen_engines": xs,
                              "gen_seconds": [prof.seconds[x] for x in xs]}}
        w = RampedWorkload(get_workload("streamrl_20k"), 0.5, 1.0, 20 * 1024)
        r = simulate(sched.load_preset("streamrl_async", over), w, "h800_streamrl_7b", s.gen, 32 - s.gen,
                     steps=SCALE_ITERS, group_size=1, prompts_per_step=1024, seed=runs.seed, spare_gpus=SCALE_SPARE,
                     ranker_recall=RANKER_RECALL)
        r.preset = "streamrl_async"
        r.split = (s.gen, 32 - s.gen)
        return r
    return runs.memo("fig11", go)


def scale_out_iterations(runs: Runs) -> list[int]:
    """The optimizer steps completed before each scale-out (Fig. 11's "after iteration 10 and 16")."""
    r = scale_out_run(runs)
    steps = [e.t for e in r.events if e.kind == "train_step_done" and e.data.get("stepped")]
    return [sum(s <= e.t for s in steps) for e in r.events if e.kind == "engines_added"]


def scale_outs(runs: Runs) -> float:
    return float(len(scale_out_iterations(runs)))


def first_scale_out(runs: Runs) -> float:
    """The iteration of the first scale-out; NaN (a miss) when there is none."""
    its = scale_out_iterations(runs)
    return float(its[0]) if its else float("nan")


# ------------------------------------------------------------------------- §7.3 / Fig. 12: cross-datacenter, H20 SGS
XDC_COST, XDC_SGS_GPUS, NODE = "h20_h800_streamrl_7b", 32, 8
MACHINE_COST = {"h800": 2.85, "h20": 1.00}    # Table 1: cost per 8-GPU machine (Zhu et al., 2025)


def xdc_split(runs: Runs) -> tuple[int, int]:
    """Algorithm 1's cross-datacenter branch (§4.2): the SGS may take up to the H20 cluster's 32 GPUs, the trainer
    the H800 training GPUs of the single-datacenter 7B run; the faster stage under full allocation shrinks, a node
    at a time, to the size whose time is nearest the other's (argmin |.| as printed)."""
    def go() -> tuple[int, int]:
        n_train = split_of(runs, "7b")[1]
        prof = profile("streamrl", "streamrl_20k", XDC_COST, XDC_SGS_GPUS + NODE, 1024, 1, runs.seed, NODE,
                       RANKER_RECALL)
        c = get_profile(XDC_COST)
        s = split_cross_dc(XDC_SGS_GPUS, n_train, prof.gen_time, lambda y: c.train_s(prof.round_tokens, y),
                           gen_unit=NODE, train_unit=NODE)
        return s.gen, s.train
    return runs.memo("xdc-split", go)


def cost_normalised_gain(runs: Runs) -> float | None:
    """StreamRL-Sync's throughput per hardware cost (Table 1's per-machine costs), cross-datacenter (SGS on H20,
    trainer on H800) over single-datacenter (all H800, Algorithm 1's split), 7B/20K."""
    gen1, train1 = split_of(runs, "7b")
    single = run(runs, "streamrl", "7b")
    gen2, train2 = xdc_split(runs)
    cross = runs.get("streamrl", Setting("streamrl_20k", XDC_COST, gen2, train2, 1024, 1, ROUNDS, sim=RANKER))
    if single is None or cross is None:
        return None
    cost1 = math.ceil((gen1 + train1) / NODE) * MACHINE_COST["h800"]
    cost2 = math.ceil(gen2 / NODE) * MACHINE_COST["h20"] + math.ceil(train2 / NODE) * MACHINE_COST["h800"]
    return (after_warmup_throughput(cross) / cost2) / (after_warmup_throughput(single) / cost1)


# --------------------------------------------------------------------------------------------------------- rows
SKEW = "Table 3 (72B/20K): ColocationRL + skewness-aware scheduling"
DISAGG_STEP = "Table 3 step: + disaggregation + streaming, over (2) (1.23 / 1.08)"
ASYNC_STEP = "Table 3 step: + asynchronous, over (3) (1.48 / 1.23)"
SKEW_GAIN = vs_colocation(None, "72b")
SYNC_GAIN, ASYNC_GAIN = vs_colocation("streamrl", "72b"), vs_colocation("streamrl_async", "72b")
ROWS = [
    Row("72B weight transfer over 80 Gb/s, bf16 (§7.3)", (0.0, 10.0), "< 10 s",
        lambda runs: QWEN25_72B.params * BYTES_PER_PARAM / (80e9 / 8), "{:.1f} s", ARITHMETIC),
    Row("StreamRL-Sync vs ColocationRL, 7B/20K (§7.1; range over 9 settings)", (1.06, 1.41), "1.06–1.41x",
        vs_colocation("streamrl", "7b"), "{:.2f}x", SPEEDUP, "32 GPUs; StreamRL on Algorithm 1's split",
        caveat="one of the 9 settings against the range over all 9 (the per-setting bars are Fig. 8's only)"),
    Row(SKEW, (1.08, 1.08), "1.08x", SKEW_GAIN, "{:.2f}x", SPEEDUP, "64 GPUs colocated, Algorithm 2 + LPT + ranker"),
    Row(DISAGG_STEP, (1.23 / 1.08, 1.23 / 1.08), "1.14x", step_gain(SYNC_GAIN, SKEW_GAIN), "{:.2f}x", SPEEDUP,
        "StreamRL-Sync over the skewness-aware ColocationRL"),
    Row(ASYNC_STEP, (1.48 / 1.23, 1.48 / 1.23), "1.20x", step_gain(ASYNC_GAIN, SYNC_GAIN), "{:.2f}x", SPEEDUP,
        "StreamRL-Async over StreamRL-Sync, the same split"),
    Row("Table 3 (72B/20K): + disaggregation + streaming (StreamRL-Sync)", (1.23, 1.23), "1.23x",
        SYNC_GAIN, "{:.2f}x", SPEEDUP, "64 GPUs on Algorithm 1's split", parts=(SKEW, DISAGG_STEP)),
    Row("Table 3 (72B/20K): + asynchronous (StreamRL-Async)", (1.48, 1.48), "1.48x",
        ASYNC_GAIN, "{:.2f}x", SPEEDUP, "64 GPUs on Algorithm 1's split", parts=(SKEW, DISAGG_STEP, ASYNC_STEP)),
    Row("§7.3 / Fig. 12: cross-DC (SGS on 32 H20) over single-DC, throughput per hardware cost, 7B/20K",
        (1.23, 1.31), "1.23–1.31x", cost_normalised_gain, "{:.2f}x", SPEEDUP,
        "StreamRL-Sync; trainer on the single-DC run's H800 GPUs; Algorithm 1's cross-DC branch",
        caveat="one of the 7B settings (5K/10K/20K) against the range over them (the bars are Fig. 12's only)"),
    Row("Fig. 10: Algorithm 1's split vs an even split, Async 72B/20K", (1.25, 1.25), "1.25x", alg1_over_even,
        "{:.2f}x", SPEEDUP, "64 GPUs",
        caveat="trainer-bound at both splits (16 + 48 and 32 + 32): the ratio reads 48 / 32 training GPUs"),
    *[Row(f"Fig. 9: generation time oracle <= ranker < random, {m}/20K (1 = yes)", (1, 1), "yes", fig9_order(m),
          "{:.0f}", LEVEL, "one round on Algorithm 1's generation GPUs") for m in MODELS],
    Row("Fig. 9: the ranker's share of the oracle's gain over random, 72B ('most')", (0.5, 1.0), "most (> 50%)",
        ranker_share("72b"), setting="one round on Algorithm 1's generation GPUs"),
    Row("Fig. 11: scale-out events as lengths ramp 10K -> 20K", (2, 2), "2",
        scale_outs, "{:.1f}", LEVEL, "StreamRL-Async, 7B, 32 GPUs + an 8-GPU node at a time"),
    Row("Fig. 11: the first scale-out, after iteration", (10, 10), "10", first_scale_out, "{:.1f}", LEVEL,
        "the same run"),
]


# -------------------------------------------------------------------------------------------------------- notes
def recall_by_round(r: SimResult, q: float, first: int = 0) -> list[float]:
    """Per round from `first` on: |predicted top q ∩ true top q| / |true top q| of the ranker as run (Table 4's
    "recall rate", our reading), from the dispatch's own record of its predictions (group id -> predicted length,
    `SkewnessDispatch.ranked`, which travels with a pooled result's policy) and the events' fields (group ids,
    rounds, finished lengths): nothing in-process only (an event's payload is not kept by a pooled result)."""
    d = r.policy.dispatch
    ranked = getattr(d, "inner", d).ranked
    g_round = {e.group_id: e.data["round"] for e in r.events if e.kind == "group_materialized"}
    rounds: dict[int, tuple[list[float], list[int]]] = {}
    for e in r.events:
        if e.kind == "trajectory_finished" and g_round.get(e.group_id, -1) >= first and e.group_id in ranked:
            pred, true = rounds.setdefault(g_round[e.group_id], ([], []))
            pred.append(ranked[e.group_id])
            true.append(e.data["tokens"])
    return [recall_at(pred, true, q) for _, (pred, true) in sorted(rounds.items())]


def ranker_note(runs: Runs) -> str:
    r = run(runs, "streamrl", "7b")
    rec = ", ".join(f"{q:.0%} {statistics.fmean(recall_by_round(r, q)):.2f}" for q in (0.2, 0.1, 0.05))
    return (f"ranker recall (StreamRL-Sync 7B/20K, every round, seed {runs.seed}): {rec} (Table 4, LLM rankers: "
            f"0.81-0.87 / 0.75-0.82 / 0.68-0.76; ours: the true length with a log-normal error set to 0.87 at 20%, "
            f"its 10% and 5% figures follow from that error's shape).")


def split_note(runs: Runs) -> str:
    parts = []
    for m in MODELS:
        gen, train = split_of(runs, m)
        prof = gen_profile(runs, m)
        table = ", ".join(f"{x}: {t:.0f} s" for x, t in sorted(prof.seconds.items()))
        p_train = get_profile(MODELS[m][1]).train_s(prof.round_tokens, train)
        parts.append(f"{m}: {gen} generation + {train} training GPUs (P_gen by GPUs: {table}; P_train {p_train:.0f} s)")
    g, t = xdc_split(runs)
    return (f"Algorithm 1's splits, seed {runs.seed}: " + "; ".join(parts)
            + f"; cross-DC 7B: {g} H20 generation + {t} H800 training GPUs.")


def scale_note(runs: Runs) -> str:
    r = scale_out_run(runs)
    at = scale_out_iterations(runs)
    gaps = ", ".join(f"{d:.0f} >= {d1:.0f} s" for _, d, d1 in r.policy.rebalance.events)
    return (f"Fig. 11, seed {runs.seed}: split {r.split[0]} + {r.split[1]} GPUs at 10K; scale-outs after iterations "
            f"{at or 'none'} (delta >= delta': {gaps or '-'}); engines at the end {r.num_engines}.")


COMPONENTS = ("simulated: disaggregated generation (H800 roofline engines: continuous batching, paged KV) and "
              "trainer (PPO FLOPs, MFU 0.25 assumed), streaming, Algorithm 2 every round with a ranker of Table 4's "
              "recall and LPT, Algorithm 1 from simulated generation profiles (and its cross-datacenter branch: H20 "
              "engines, the H800 trainer, the weights over an 80 Gb/s link), one-step asynchrony with overlapped "
              "weight transfer, scale-out onto spare GPUs; ColocationRL = sync colocated on the same engines and "
              "trainer. Not simulated: verl's framework differences, broadcast trees, an LLM ranker (ours: true "
              "lengths with a log-normal error of Table 4's recall).")
PAPER = Paper(ROWS, components=COMPONENTS, notes=[split_note, ranker_note, fig9_note, scale_note],
              reads_policy=True)   # the ranker's order and the scale-out events

"""Laminar (§2.3, §8): trajectory-level asynchrony with relays and repack, against verl, one-step, stream generation
and AReaL."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from sched.metrics import engine_spans, kv_utilisation, trainer_spans
from sim.cost import relay_broadcast_s
from sim.profiles import BYTES_PER_PARAM, LAMINAR_CHUNK, LAMINAR_NIC_BW, LAMINAR_T_START, QWEN25_72B
from sim.repro.core import ARITHMETIC, BOUND, SPEEDUP, Paper, Row, Runs, Setting, gather
from sim.repro.figures import (after_warmup_throughput, end_t, generation_tps, length_bias, metric, of,
                                reprefill_share, rollout_idle_ratio, round_figures)
from sim.repro.placement import per_sample_balanced_split
from sim.run import SimResult

# Laminar §2.3/§8: verl colocated at the largest scale, Qwen2.5-72B on 1024 H800 (rollout TP 8), 512 prompts x 16,
# max output 16K, math GRPO (the Laminar profile: rule-based reward, no reference model); two rounds.
LM_VERL = Setting("laminar_16k", "h800_laminar_72b_colocated", 128, 1024, 512, 16, 2, colocated=True)

# Laminar §8.1 / Fig. 11 (math): Qwen2.5-32B at the 128-GPU scale of Table 2 (row 3) stands for the paper's averages
# over 3 models x 5 scales (the per-setting points are only plotted): verl colocated on all 128 GPUs (rollout TP 4,
# 32 engines). Every disaggregated system (one-step, stream generation, AReaL, Laminar) runs at its own split by
# §8.1's rule, "we tune the optimal placement under each baseline by matching the generation and training
# throughput" (`lm_split`), starting from Table 2's (one-step and stream generation 48 train + 80 rollout GPUs, 20
# engines; AReaL and Laminar 64 + 64, 16 engines). The repack ablation (§8.4, Table 1) and the machine kill (§8.5)
# name their setting, 64 + 64, and keep it. 512 prompts x 16, max output 16K (laminar_16k).
# Throughput is the paper's: tokens (prompt + response) trained per second over the iterations after the second
# (the paper averages 5 after a 10-iteration warm-up); samples/s would favour Laminar's FIFO buffer, which trains a
# short-biased subset of what it generates (a note prints that bias and the backlog). 8 iterations here. The
# Laminar runs report engine counters every simulated second (the repack monitor's input, the KV-utilisation and
# generation-rate rows); no other system reads them, so theirs are off.
LM_ROUNDS, LM_WARMUP = 8, 2
# §2.3's one-step figure at the same scale: Table 2's row 5 gives one-step 256 train + 768 rollout GPUs (96 engines of
# TP 8); four rounds, its idle share measured after the pipeline's first step (the first round has nothing to train).
LM_ONE_STEP_72B = Setting("laminar_16k", "h800_laminar_72b", 96, 256, 512, 16, 4)
LM_VERL_32B = Setting("laminar_16k", "h800_laminar_32b_colocated", 32, 128, 512, 16, LM_ROUNDS, colocated=True)
LM_PIPE = Setting("laminar_16k", "h800_laminar_32b", 20, 48, 512, 16, LM_ROUNDS)
LM_EVEN = Setting("laminar_16k", "h800_laminar_32b", 16, 64, 512, 16, LM_ROUNDS)
# App. A.3: "1024 trajectories per replica" = 64 groups of 16 per engine batch (the preset's default, 0, would split
# the 512 prompts evenly: 32 groups on 16 engines). A paper setting, applied to every Laminar run below.
LM_BATCH = (("dispatch", (("batch_groups", 64),)),)
NO_REPACK = LM_BATCH + (("rebalance", (("name", "none"),)),)
LAMINAR_RUN = ("laminar", LM_EVEN, LM_BATCH)
# AReaL as Laminar ran it: staleness unbounded in the throughput runs (§8.1: "set AReaL's to infinity") and "maximum
# concurrency to 1024 trajectories per rollout replica" (App. A.3) = 64 groups of 16 per engine. An eta no run can
# reach stands for infinity (the dispatch's cap (eta + u + 1) x batch and the hand-off's strand check never bind).
AREAL_UNBOUNDED = (("dispatch", (("eta", 10**6), ("per_engine", 64))),)
AREAL_RUN = ("areal", LM_EVEN, AREAL_UNBOUNDED)

# §8.1's placement rule, the same for every disaggregated system: Table 2's split is the starting point; the system's
# own run there measures each stage's work per trained sample (sim/repro/placement.py `per_sample_balanced_split`:
# an unbounded buffer keeps every engine busy at any split, so its over-generation is not work the trainer needs);
# the GPUs are re-divided in proportion, in whole 8-GPU machines (two TP-4 replicas each); of the two splits the one
# with the higher throughput is kept. Chosen once on the first seed's runs, kept for every seed.
@dataclass(frozen=True)
class System:
    """A disaggregated system of the comparison: its preset, Table 2's split (the rule's start), its overrides, and
    the cluster the rule re-divides (GPUs in all, a machine's GPUs, GPUs per engine)."""
    preset: str
    start: Setting
    overrides: tuple = ()
    gpus: int = 128
    node: int = 8
    tp: int = 4

    def split_text(self, s: Setting) -> str:
        return f"{s.num_engines * self.tp} rollout + {s.train_gpus} train"


LM_SYSTEMS: dict[str, System] = {"laminar": System("laminar", LM_EVEN, LM_BATCH),
                                 "one_step": System("one_step", LM_PIPE),
                                 "stream_generation": System("stream_generation", LM_PIPE),
                                 "areal": System("areal", LM_EVEN, AREAL_UNBOUNDED),
                                 "one_step_72b": System("one_step", LM_ONE_STEP_72B, (), 1024, 8, 8)}
# A system is trainer-bound when its trainer idles less than this share of the after-warm-up window while its
# engines could generate more than this share beyond what it trains; a comparison of two trainer-bound systems
# reads their train-GPU ratio, not Laminar's mechanisms (a row's caveat). A quarter of the hit rule's 20%.
TRAINER_BOUND = 0.05


def lm_get(runs: Runs, preset: str, s: Setting, overrides: tuple = ()) -> SimResult | None:
    """Runs.get, with engine counters every simulated second for Laminar's runs (repack's KV monitor, the
    KV-utilisation and generation-rate rows)."""
    return runs.get(preset, s, overrides, counters_every_s=1.0 if preset == "laminar" else None)


def steady_throughput(r: SimResult) -> float:
    """Tokens trained per second after Laminar's LM_WARMUP iterations (after_warmup_throughput's definition)."""
    return after_warmup_throughput(r, LM_WARMUP, "tokens")


def lm_balanced(runs: Runs, name: str) -> Setting:
    """The split that matches the system's generation and training throughput, measured on its first-seed run at
    Table 2's split."""
    first, sy = runs.first, LM_SYSTEMS[name]

    def choose() -> Setting:
        r = lm_get(first, sy.preset, sy.start, sy.overrides)
        return sy.start if r is None else per_sample_balanced_split(r, sy.start, sy.gpus, sy.node, sy.tp)
    return first.memo(("laminar-balanced", name), choose)


def lm_split(runs: Runs, name: str) -> Setting:
    """The system's split by §8.1's rule (module comment): of Table 2's split and `lm_balanced`, the one whose
    first-seed run trains more tokens per second; kept for every seed (choosing per seed would pick each seed's
    luckier split)."""
    first, sy = runs.first, LM_SYSTEMS[name]

    def choose() -> Setting:
        b = lm_balanced(first, name)
        if b == sy.start:
            return sy.start
        here, there = gather([lambda: lm_get(first, sy.preset, sy.start, sy.overrides),
                              lambda: lm_get(first, sy.preset, b, sy.overrides)])
        if here is None or there is None:
            return sy.start
        return b if steady_throughput(there) > steady_throughput(here) else sy.start
    return first.memo(("laminar-split", name), choose)


def lm_system(name: str) -> Callable[[Runs], SimResult | None]:
    """The system's run at its split (`lm_split`); verl ("sync") is colocated on all 128 GPUs."""
    def get(runs: Runs) -> SimResult | None:
        if name == "sync":
            return lm_get(runs, "sync", LM_VERL_32B)
        sy = LM_SYSTEMS[name]
        return lm_get(runs, sy.preset, lm_split(runs, name), sy.overrides)
    return get


def _window(r: SimResult, warmup: int = LM_WARMUP) -> tuple[float, float]:
    """The after-warm-up window: the end of optimizer step `warmup` to the end of the last."""
    steps = [e.t for e in of(r, "train_step_done") if e.data.get("stepped", True)]
    if len(steps) <= warmup:
        raise RuntimeError(f"{r.preset}: only {len(steps)} optimizer steps")
    return steps[warmup - 1], steps[-1]


def gpu_idle_share(r: SimResult, gpus_per_engine: int, warmup: int = 1) -> float:
    """A disaggregated run's "GPU completely idle" share (Laminar §2.3): GPU-seconds with nothing to do (an engine
    with no request, a train GPU between train calls) over all GPU-seconds, from the end of optimizer step `warmup`
    (a pipeline's first round has nothing to train) to the last step's end."""
    t0, t1 = _window(r, warmup)
    clip = lambda a, b: max(0.0, min(b, t1) - max(a, t0))   # noqa: E731
    eng_busy = sum(clip(a, b) for spans in engine_spans(of(r, "engine_busy", "engine_idle"), t1).values()
                   for a, b in spans)
    train_busy = sum(clip(a, b) for a, b, _ in trainer_spans(of(r, "train_started", "train_step_done")))
    gpus = r.num_engines * gpus_per_engine + r.train_gpus
    idle = (r.num_engines * (t1 - t0) - eng_busy) * gpus_per_engine + ((t1 - t0) - train_busy) * r.train_gpus
    return idle / (gpus * (t1 - t0))


def trainer_idle_share(r: SimResult) -> float:
    """Share of the after-warm-up window in which no train call runs."""
    t0, t1 = _window(r)
    calls = trainer_spans(of(r, "train_started", "train_step_done"))
    busy = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b, _ in calls)
    return 1.0 - busy / (t1 - t0)


def generation_headroom(r: SimResult) -> float:
    """How much more the engines could generate than the run trains, in the after-warm-up window: samples finished
    per sample trained there, over the engines' busy share there, minus 1 (engines idle waiting for the trainer,
    or a growing backlog, are headroom; a pipeline's one round in flight is not, as a whole-run count would read)."""
    t0, t1 = _window(r)
    finished = sum(1 for e in of(r, "trajectory_finished") if t0 < e.t <= t1)
    trained = sum(e.data.get("samples", 0) for e in of(r, "train_step_done") if t0 < e.t <= t1)
    spans = engine_spans(of(r, "engine_busy", "engine_idle"), t1)
    busy = sum(max(0.0, min(b, t1) - max(a, t0)) for s in spans.values() for a, b in s)
    return finished / trained / max(1e-9, busy / (r.num_engines * (t1 - t0))) - 1.0


def trainer_bound(r: SimResult) -> bool:
    """The TRAINER_BOUND criterion: the trainer (nearly) never waits and the engines have headroom."""
    return trainer_idle_share(r) < TRAINER_BOUND and generation_headroom(r) > TRAINER_BOUND


TRAINER_BOUND_CAVEAT = "trainer-bound: mechanism not exercised"


class Comparison:
    """Laminar over `base` in tokens/s after warm-up, each at its split (`lm_system`). On the first seed's runs it
    sets its row's caveat when both runs are trainer-bound (`trainer_bound`): the ratio then reads train GPUs."""

    def __init__(self, base: str):
        self.base = base
        self.row: Row | None = None

    def __call__(self, runs: Runs) -> float | None:
        if self.row is not None and runs.first is runs:
            self.row.caveat = ""
        lam, other = gather([lambda: lm_system("laminar")(runs), lambda: lm_system(self.base)(runs)])
        if lam is None or other is None:
            return None
        if self.row is not None and runs.first is runs and trainer_bound(lam) and trainer_bound(other):
            self.row.caveat = TRAINER_BOUND_CAVEAT
        return steady_throughput(lam) / steady_throughput(other)


def lm_ratio(runs: Runs, a: tuple, b: tuple, fn: Callable[[SimResult], float]) -> float | None:
    ra, rb = gather([lambda: lm_get(runs, *a), lambda: lm_get(runs, *b)])   # both queued at once
    return None if ra is None or rb is None else fn(ra) / fn(rb)


def lm_metric(get: Callable[[Runs], SimResult | None],
              fn: Callable[[SimResult], float]) -> Callable[[Runs], float | None]:
    def f(runs: Runs) -> float | None:
        r = get(runs)
        return None if r is None else fn(r)
    return f


def kv_row(r: SimResult) -> float:
    """Table 1's average KV utilisation of a run (sched.metrics.kv_utilisation over its counters and idle events)."""
    return kv_utilisation(of(r, "engine_idle", "tokens_decoded"), r.num_engines, end=end_t(r))


def run_of(preset: str, s: Setting, overrides: tuple = ()) -> Callable[[Runs], SimResult | None]:
    return lambda runs: lm_get(runs, preset, s, overrides)


COMPARED = (("verl", 2.56, "sync"), ("one-step", 1.98, "one_step"), ("stream generation", 1.93, "stream_generation"),
            ("AReaL", 1.39, "areal"))
SPEEDUP_ROWS = [Row(f"Laminar vs {name}, math, average (§8.1)", (x, x), f"{x:.2f}x", Comparison(base), "{:.2f}x",
                    SPEEDUP, "tokens/s after 2 warm-up iterations, each system at its split by §8.1's rule")
                for name, x, base in COMPARED]
for _row in SPEEDUP_ROWS:
    _row.compute.row = _row

LAMINAR = [
    Row("verl: GPU completely idle, largest scale (§2.3)", (0.492, 0.492), "49.2%",
        metric(("sync", LM_VERL), rollout_idle_ratio)),
    Row("verl: generation share of iteration, up to (Fig. 1b)", (0.831, 0.831), "83.1%",
        metric(("sync", LM_VERL), lambda r: round_figures(r)["pre_train_share"])),
    Row("one-step: GPU completely idle, largest scale (§2.3)", (0.223, 0.223), "22.3%",
        lm_metric(lm_system("one_step_72b"), lambda r: gpu_idle_share(r, 8)),
        setting="72B on 1024 GPUs at its split, after its first step"),
    *SPEEDUP_ROWS,
    # §2.3 measures partial rollout's re-prefill without naming its setting ([GAP]); ours is the AReaL throughput run
    Row("AReaL (partial rollout): re-prefill share of rollout time (§2.3)", (0.241, 0.241), "24.1%",
        lm_metric(lm_system("areal"), reprefill_share), setting="AReaL's throughput run, 32B, at its split"),
    Row("repack: generation throughput gain, 32B/128 GPUs (§8.4)", (0.26, 0.26), "+26%",
        lambda runs: lm_ratio(runs, LAMINAR_RUN, ("laminar", LM_EVEN, NO_REPACK), generation_tps) - 1,
        setting="64 + 64 (§8.4's setting)"),
    Row("repack: average KV utilisation with repack (Table 1)", (0.822, 0.822), "82.2%",
        lm_metric(run_of(*LAMINAR_RUN), kv_row),
        setting="64 + 64 (§8.4's setting)"),
    Row("repack: average KV utilisation without repack (Table 1)", (0.716, 0.716), "71.6%",
        lm_metric(run_of("laminar", LM_EVEN, NO_REPACK), kv_row),
        setting="64 + 64 (§8.4's setting)"),
    Row("relay broadcast, 72B, master -> 127 relays (§4.2, Fig. 19)", (0.0, 1.6), "< 1.6 s",
        lambda runs: relay_broadcast_s(QWEN25_72B.params * BYTES_PER_PARAM, 127, LAMINAR_NIC_BW, LAMINAR_CHUNK,
                                       LAMINAR_T_START), "{:.2f} s", ARITHMETIC, "App. C's closed form"),
    # §6's inherent staleness M - K: the trainer's version when the trajectory finished minus its generating version
    # (the consume-time figure, metrics["staleness_max"], also counts the wait in the experience buffer).
    Row("max staleness, Laminar (§6/§8.1: max 4 observed; typically < 3)", (0, 4), "<= 4",
        lm_metric(lm_system("laminar"), lambda r: float(r.metrics["staleness_at_finish_max"])), "{:.0f}", BOUND,
        "Laminar's throughput run"),
]

NAMES = {"laminar": "Laminar", "one_step": "one-step", "stream_generation": "stream generation", "areal": "AReaL",
         "one_step_72b": "one-step (72B, 1024 GPUs)"}


def note_placement(runs: Runs) -> str:
    """Each system's Table-2 split and its balanced split with their tokens/s (seed 0), and the one kept."""
    parts = []
    for name, sy in LM_SYSTEMS.items():
        b, kept = lm_balanced(runs, name), lm_split(runs, name)
        tps = steady_throughput(lm_get(runs, sy.preset, sy.start, sy.overrides))
        text = f"{NAMES[name]}: Table 2's {sy.split_text(sy.start)} {tps:,.0f}"
        if b != sy.start:
            text += f", balanced {sy.split_text(b)} {steady_throughput(lm_get(runs, sy.preset, b, sy.overrides)):,.0f}"
        else:
            text += " (balanced: the same split)"
        parts.append(text + f"; kept {sy.split_text(kept)}")
    return ("Placement by §8.1's rule (tokens/s after warm-up, seed 0; the split kept for every seed): "
            + "; ".join(parts) + ". verl: colocated on all 128 GPUs.")


def note_trainer_bound(runs: Runs) -> str:
    """The trainer-bound criterion's measurements behind the rows' caveats (seed 0)."""
    parts = []
    for preset in ("laminar", "one_step", "stream_generation", "areal"):
        r = lm_system(preset)(runs)
        parts.append(f"{NAMES[preset]} ({r.train_gpus} train GPUs) idle {trainer_idle_share(r):.1%}, headroom "
                     f"{generation_headroom(r):+.0%}{' -> trainer-bound' if trainer_bound(r) else ''}")
    lam = lm_system("laminar")(runs)
    ratios = "; ".join(f"vs {NAMES[p]} {steady_throughput(lam) / steady_throughput(lm_system(p)(runs)):.3f}x "
                       f"(train GPUs {lam.train_gpus}/{lm_system(p)(runs).train_gpus} = "
                       f"{lam.train_gpus / lm_system(p)(runs).train_gpus:.3f})"
                       for p in ("one_step", "stream_generation", "areal"))
    return (f"Trainer-bound (a row's caveat when both systems are): trainer idle under {TRAINER_BOUND:.0%} of the "
            f"after-warm-up window and generation headroom (finished per trained sample / engines' busy share - 1) "
            f"above {TRAINER_BOUND:.0%}, seed 0: " + "; ".join(parts) + f". Laminar {ratios}.")


def note_verl_share(runs: Runs) -> str:
    """verl's training share and the bound it puts on a trainer-bound Laminar's lead (seed 0)."""
    verl, lam = lm_system("sync")(runs), lm_system("laminar")(runs)
    s = round_figures(verl)["train_share"]
    n = lam.train_gpus
    return (f"verl (32B, colocated on 128) trains {s:.1%} of each iteration: a Laminar bound by its {n} train GPUs "
            f"reaches at most {n} / (128 x {s:.3f}) = {n / (128 * s):.2f}x verl; the paper's 2.56x needs a "
            f"share <= {n / (128 * 2.56):.1%} at this split (`--train-speed F` shows the rows' dependence).")


def note_bias(runs: Runs) -> str:
    """What each system trained against what it generated (the samples-vs-tokens bias) and its backlog."""
    parts = []
    for preset in ("laminar", "areal", "stream_generation", "one_step", "sync"):
        r = lm_system(preset)(runs)
        if r is None:
            continue
        b = length_bias(r)
        samples = after_warmup_throughput(r, LM_WARMUP)
        parts.append(f"{NAMES.get(preset, 'verl')} {b['trained_len']:.0f} / {b['generated_len']:.0f} tokens "
                     f"({b['bias']:.2f}), {b['overgeneration']:.2f} generated per trained, backlog "
                     f"{b['backlog_groups']:.0f} groups + {b['in_flight']:.0f} requests, {samples:.1f} samples/s")
    return "Trained vs generated mean response length (seed 0, at each split): " + "; ".join(parts) + "."


PAPER = Paper(LAMINAR, notes=[note_placement, note_trainer_bound, note_verl_share, note_bias],
              components="Simulated: Laminar's per-engine batches, pull-latest weight sync from the relays (the App. C "
                         "broadcast time), FIFO experience buffer and repack (Alg. 1, a move sends the KV over the "
                         "NIC); verl colocated, one-step, stream generation (FIFO + streamed hand-off) and "
                         "AReaL (unbounded, 1024 trajectories per replica). Fault isolation and the partial response "
                         "pool run in `python -m sim.repro.laminar_faults` (§8.5, not rows). Not simulated: relays' "
                         "decode-path isolation (the runtime's concern), 7B/72B and the other 4 scales of Fig. 11.",
              reads_kinds=frozenset({"round_started", "engine_busy", "engine_idle", "tokens_decoded",
                                     "trajectory_finished", "group_materialized", "train_started",
                                     "train_step_done"}))

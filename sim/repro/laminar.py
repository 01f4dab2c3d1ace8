"""Laminar (§2.3, §8): trajectory-level asynchrony with relays and repack, against verl, one-step, stream generation
and AReaL."""
from __future__ import annotations

from typing import Callable

from sched.metrics import kv_utilisation
from sim.cost import relay_broadcast_s
from sim.profiles import BYTES_PER_PARAM, LAMINAR_CHUNK, LAMINAR_NIC_BW, LAMINAR_T_START, QWEN25_72B
from sim.repro.core import SPEEDUP, Paper, Row, Runs, Setting, gather
from sim.repro.figures import (after_warmup_throughput, generation_tps, length_bias, metric, reprefill_share,
                                rollout_idle_ratio, round_figures)
from sim.run import SimResult

# Laminar §2.3/§8: verl colocated at the largest scale, Qwen2.5-72B on 1024 H800 (rollout TP 8), 512 prompts x 16,
# max output 16K, math GRPO (the Laminar profile: rule-based reward, no reference model); two rounds.
LM_VERL = Setting("laminar_16k", "h800_laminar_72b_colocated", 128, 1024, 512, 16, 2, colocated=True)

# Laminar §8.1 / Fig. 11 (math): Qwen2.5-32B at the 128-GPU scale of Table 2 (row 3) stands for the paper's averages
# over 3 models x 5 scales (the per-setting points are only plotted): verl colocated on all 128 GPUs (rollout TP 4,
# 32 engines); one-step and stream generation 48 train + 80 rollout GPUs (20 engines); AReaL and Laminar 64 + 64
# (16 engines: also the repack ablation's setting, §8.4); the paper hand-tuned these placements for each system
# ("to maximize throughput", App. A.3), so they are used as given. 512 prompts x 16, max output 16K (laminar_16k).
# Throughput is the paper's: tokens (prompt + response) trained per second over the iterations after the second
# (the paper averages 5 after a 10-iteration warm-up); samples/s would favour Laminar's FIFO buffer, which trains a
# short-biased subset of what it generates (a note prints that bias and the backlog). 8 iterations here. The
# Laminar runs report engine counters every simulated second (the repack monitor's input, the KV-utilisation and
# generation-rate rows); no other system reads them, so theirs are off.
LM_ROUNDS, LM_WARMUP = 8, 2
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


def lm_get(runs: Runs, preset: str, s: Setting, overrides: tuple = ()) -> SimResult | None:
    """Runs.get, with engine counters every simulated second for Laminar's runs (repack's KV monitor, the
    KV-utilisation and generation-rate rows)."""
    return runs.get(preset, s, overrides, counters_every_s=1.0 if preset == "laminar" else None)


def steady_throughput(r: SimResult) -> float:
    """Tokens trained per second after Laminar's LM_WARMUP iterations (after_warmup_throughput's definition)."""
    return after_warmup_throughput(r, LM_WARMUP, "tokens")


def lm_ratio(runs: Runs, a: tuple, b: tuple, fn: Callable[[SimResult], float]) -> float | None:
    ra, rb = gather([lambda: lm_get(runs, *a), lambda: lm_get(runs, *b)])   # both in one wave of the pool
    return None if ra is None or rb is None else fn(ra) / fn(rb)


def lm_speedup(base: tuple) -> Callable[[Runs], float | None]:
    return lambda runs: lm_ratio(runs, LAMINAR_RUN, base, steady_throughput)


def lm_metric(runs: Runs, preset: tuple, fn: Callable[[SimResult], float]) -> float | None:
    r = lm_get(runs, *preset)
    return None if r is None else fn(r)


LAMINAR = [
    Row("verl: GPU completely idle, largest scale (§2.3)", (0.492, 0.492), "49.2%",
        metric(("sync", LM_VERL), rollout_idle_ratio)),
    Row("verl: generation share of iteration, up to (Fig. 1b)", (0.831, 0.831), "83.1%",
        metric(("sync", LM_VERL), lambda r: round_figures(r)["pre_train_share"])),
    *[Row(f"Laminar vs {name}, math, average (§8.1)", (x, x), f"{x:.2f}x", lm_speedup(base), "{:.2f}x", SPEEDUP,
          "tokens/s after 2 warm-up iterations")
      for name, x, base in (("verl", 2.56, ("sync", LM_VERL_32B)), ("one-step", 1.98, ("one_step", LM_PIPE)),
                            ("stream generation", 1.93, ("stream_generation", LM_PIPE)),
                            ("AReaL", 1.39, AREAL_RUN))],
    # §2.3 measures partial rollout's re-prefill without naming its setting ([GAP]); ours is the AReaL throughput run
    Row("AReaL (partial rollout): re-prefill share of rollout time (§2.3)", (0.241, 0.241), "24.1%",
        lambda runs: lm_metric(runs, AREAL_RUN, reprefill_share), setting="AReaL's throughput run, 32B on 64 + 64"),
    Row("repack: generation throughput gain, 32B/128 GPUs (§8.4)", (0.26, 0.26), "+26%",
        lambda runs: lm_ratio(runs, LAMINAR_RUN, ("laminar", LM_EVEN, NO_REPACK), generation_tps) - 1),
    Row("repack: average KV utilisation with repack (Table 1)", (0.822, 0.822), "82.2%",
        lambda runs: lm_metric(runs, LAMINAR_RUN, lambda r: kv_utilisation(r.events, r.num_engines))),
    Row("repack: average KV utilisation without repack (Table 1)", (0.716, 0.716), "71.6%",
        lambda runs: lm_metric(runs, ("laminar", LM_EVEN, NO_REPACK),
                               lambda r: kv_utilisation(r.events, r.num_engines))),
    Row("relay broadcast, 72B, master -> 127 relays (§4.2, Fig. 19)", (0.0, 1.6), "< 1.6 s",
        lambda runs: relay_broadcast_s(QWEN25_72B.params * BYTES_PER_PARAM, 127, LAMINAR_NIC_BW, LAMINAR_CHUNK,
                                       LAMINAR_T_START), "{:.2f} s"),
    # §6's inherent staleness M - K: the trainer's version when the trajectory finished minus its generating version
    # (the consume-time figure, metrics["staleness_max"], also counts the wait in the experience buffer).
    Row("max staleness, Laminar (§6/§8.1: max 4 observed; typically < 3)", (0, 4), "<= 4",
        lambda runs: lm_metric(runs, LAMINAR_RUN, lambda r: float(r.metrics["staleness_at_finish_max"])), "{:.0f}"),
]

def note_bias(runs: Runs) -> str:
    """What each system trained against what it generated (the samples-vs-tokens bias) and its backlog."""
    parts = []
    for name, run in (("Laminar", LAMINAR_RUN), ("AReaL", AREAL_RUN), ("stream", ("stream_generation", LM_PIPE)),
                      ("one-step", ("one_step", LM_PIPE)), ("verl", ("sync", LM_VERL_32B))):
        r = lm_get(runs, *run)
        if r is None:
            continue
        b = length_bias(r)
        samples = after_warmup_throughput(r, LM_WARMUP)
        parts.append(f"{name} {b['trained_len']:.0f} / {b['generated_len']:.0f} tokens ({b['bias']:.2f}), "
                     f"{b['overgeneration']:.2f} generated per trained, backlog {b['backlog_groups']:.0f} groups + "
                     f"{b['in_flight']:.0f} requests, {samples:.1f} samples/s")
    return "Trained vs generated mean response length (seed 0): " + "; ".join(parts) + "."


PAPER = Paper(LAMINAR, notes=[note_bias],
              components="Simulated: Laminar's per-engine batches, pull-latest weight sync from the relays (the App. C "
                         "broadcast time), FIFO experience buffer and repack (Alg. 1, a move sends the KV over the "
                         "NIC); verl colocated, one-step, stream generation (FIFO + streamed hand-off) and "
                         "AReaL (unbounded, 1024 trajectories per replica). Fault isolation and the partial response "
                         "pool run in `python -m sim.repro.laminar_faults` (§8.5, not rows). Not simulated: relays' "
                         "decode-path isolation (the runtime's concern), 7B/72B and the other 4 scales of Fig. 11.")

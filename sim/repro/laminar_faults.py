"""Laminar §8.5 (Fig. 16): a rollout machine killed mid-run, on the reproduction's Laminar setting. Not a counted row.

    python -m sim.repro.laminar_faults [--seed 0] [--stream-every 10] [--train-speed 1]

The paper "manually kill[s] a rollout machine containing two replicas" in the setting of its throughput runs:
generation throughput drops at once, "training throughput remains unaffected or experiences a slight drop while
waiting for adequate trajectories from remaining healthy rollouts", and "the system recovers in approximately 252
seconds, including allocating a new machine and initializing the rollouts on it". Here: Laminar on Qwen2.5-32B at
64 + 64 H800 (sim/repro/laminar.py `LAMINAR_RUN`: 16 engines of TP 4, two per 8-GPU machine, 1024 trajectories
per engine batch), run once without a fault and once with engines 0 and 1 (one machine) killed at the end of the
fault-free run's fourth iteration (after the two warm-up iterations, so the outage and the recovery lie inside the
measured ones) and back 252 s later, empty and without weights (sim/backend.py `EngineFault`). The 252 s is the
paper's measured recovery, used as the outage's length: an input, so the recovery time is not a result here.

What the run shows, each against the fault-free run over the same window of the virtual clock: the generation rate
(tokens decoded per second, every engine) before, during and after the outage; the trainer's throughput over the
measured iterations (the reproduction's tokens/s after warm-up) and each train step's delay; what the
partial-response pool saved (trajectories resumed on other engines, tokens kept) and what the kill lost (tokens
generated since each request's last stream, `--stream-every` seconds apart: an assumption, the paper gives no
streaming granularity); and that nothing was lost or trained twice (every sample of every trained group trained
once, the same count as the fault-free run). Last line: training throughput with the fault over without.

In this model Laminar's 16 engines generate about two batches per trainer step at this placement (the throughput
rows' missing detail, sim/repro/laminar.md), so the trainer has a backlog to draw on through the outage;
`--train-speed F` (every profile trains F times faster per token, as `python -m sim.repro --train-speed`) is the
sensitivity that brings generation and training closer to balance.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, replace

from sched.views import IN_FLIGHT
from sim.backend import EngineFault
from sim.repro.core import Sensitivity, SimSpec, _scaled_profiles
from sim.repro.figures import after_warmup_throughput
from sim.repro.laminar import LAMINAR_RUN, LM_WARMUP
from sim.run import SimResult

RECOVERY_S = 252.0             # Laminar §8.5's measured recovery (a new machine allocated and its rollouts started)
MACHINE = (0, 1)               # one 8-GPU machine = two TP-4 replicas
KILL_AFTER_ITERATION = 4       # of the fault-free run's 8 (LM_ROUNDS), after its LM_WARMUP = 2 warm-up iterations


@dataclass
class FaultFigures:
    kill_s: float
    windows: list[tuple[str, float, float, float, float]]   # (name, start, end, gen rate with the fault, without)
    train_ratio: float        # trained tokens/s after warm-up, with the fault over without
    max_step_delay_s: float   # the largest delay of a train step's end against the fault-free run
    resumed: int
    tokens_kept: int
    tokens_lost: int
    samples: tuple[int, int]  # samples trained with the fault, without
    back_decoding_s: float    # kill -> the first failed engine decoding again (outage + weight load + prefill)


def fault_spec(seed: int, kill_s: float, stream_every_s: float) -> SimSpec:
    preset, setting, overrides = LAMINAR_RUN
    fault = EngineFault(kill_s, MACHINE, RECOVERY_S)
    sim = setting.sim + (("faults", (fault,)), ("stream_every_s", stream_every_s))
    return SimSpec(preset, overrides, replace(setting, sim=sim), seed, counters_every_s=1.0)


def reference_spec(seed: int) -> SimSpec:
    preset, setting, overrides = LAMINAR_RUN
    return SimSpec(preset, overrides, setting, seed, counters_every_s=1.0)


def step_ends(r: SimResult) -> list[float]:
    return [e.t for e in r.events if e.kind == "train_step_done" and e.data.get("stepped", True)]


def decoded_between(r: SimResult, t0: float, t1: float) -> float:
    """Tokens the engines reported decoded in (t0, t1] (counters every simulated second)."""
    return sum(e.data.get("tokens", 0) for e in r.events if e.kind == "tokens_decoded" and t0 < e.t <= t1)


def figures(ref: SimResult, hit: SimResult, kill_s: float, down_s: float) -> FaultFigures:
    """The fault run `hit` against the fault-free `ref`, for MACHINE killed at kill_s for down_s: windows of down_s
    before, during and after the outage."""
    back = kill_s + down_s
    wins = [("before the kill", kill_s - down_s, kill_s), ("outage", kill_s, back),
            ("after recovery", back, back + down_s)]
    windows = [(name, a, b, decoded_between(hit, a, b) / (b - a), decoded_between(ref, a, b) / (b - a))
               for name, a, b in wins]
    rec = [e.data for e in hit.events if e.kind == "trajectories_recovered"]
    busy = [e.t for e in hit.events if e.kind == "engine_busy" and e.engine in MACHINE and e.t > back]
    ends_hit, ends_ref = step_ends(hit), step_ends(ref)
    return FaultFigures(
        kill_s, windows,
        after_warmup_throughput(hit, LM_WARMUP, "tokens") / after_warmup_throughput(ref, LM_WARMUP, "tokens"),
        max(a - b for a, b in zip(ends_hit, ends_ref)), sum(d["resumed"] for d in rec),
        sum(d["tokens_kept"] for d in rec), sum(d["tokens_lost"] for d in rec),
        (hit.metrics["samples_trained"], ref.metrics["samples_trained"]),
        (min(busy) - kill_s) if busy else float("nan"))


def check_nothing_lost(r: SimResult) -> None:
    """Every request a killed engine held finished later or is still in flight at the end (none lost); every group
    of a finished train call trained once, with exactly G samples scored (none twice), and as many samples trained
    as those groups hold."""
    held = {int(rid) for e in r.events if e.kind == "engine_failed" for rid in e.data.get("held", {})}
    finished = {e.req_id for e in r.events if e.kind == "trajectory_finished"}
    flying = {q.req_id for q in r.views.requests.in_state(*IN_FLIGHT)}
    gone = sorted(held - finished - flying)
    calls = [e.data["groups"] for e in r.events if e.kind == "train_started"]
    done = sum(1 for e in r.events if e.kind == "train_step_done")   # one call at a time: the first `done` ended
    trained = Counter(g for gids in calls[:done] for g in gids)
    twice = [g for g, n in trained.items() if n > 1]
    scored = Counter(e.group_id for e in r.events if e.kind == "reward_scored")
    G = r.views.group_size
    wrong = {g: scored[g] for g in trained if scored[g] != G}
    if gone or twice or wrong or r.metrics["samples_trained"] != len(trained) * G:
        raise AssertionError(f"requests a killed engine held that never finished {gone[:5]}, groups trained twice "
                             f"{twice[:5]}, scored other than {G} times {list(wrong.items())[:5]}, "
                             f"{r.metrics['samples_trained']} samples trained for {len(trained)} groups")


def ratio(a: float, b: float) -> str:
    """a / b as 'N.NNx', or 'n/a' where the fault-free run generated nothing in the window (it had ended)."""
    return f"{a / b:.2f}x" if b else "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stream-every", type=float, default=10.0, metavar="S",
                    help="seconds of virtual time between partial-trajectory streams (default 10; a whole number)")
    ap.add_argument("--train-speed", type=float, default=1.0, metavar="F",
                    help="sensitivity: every cost profile trains F times faster per token (default 1)")
    args = ap.parse_args(argv)
    if not args.train_speed > 0:
        ap.error(f"--train-speed must be > 0, got {args.train_speed}")
    if not (args.stream_every >= 1 and args.stream_every == int(args.stream_every)):
        ap.error(f"--stream-every must be a whole number of seconds >= 1 (the engines' counters tick every second), "
                 f"got {args.stream_every:g}")
    with _scaled_profiles(Sensitivity(train_speed=args.train_speed)):
        ref = reference_spec(args.seed).run()
        kill_s = step_ends(ref)[KILL_AFTER_ITERATION - 1]
        hit = fault_spec(args.seed, kill_s, args.stream_every).run()
    check_nothing_lost(hit)
    f = figures(ref, hit, kill_s, RECOVERY_S)
    setting = LAMINAR_RUN[1]
    print(f"Laminar §8.5 on {setting.cost} ({setting.num_engines} engines + {setting.train_gpus} train GPUs), seed "
          f"{args.seed}: engines {list(MACHINE)} killed at {kill_s:.0f} s (end of iteration {KILL_AFTER_ITERATION}), "
          f"back after {RECOVERY_S:g} s (the paper's recovery, an input); partial trajectories streamed every "
          f"{args.stream_every:g} s" + (f"; training {args.train_speed:g}x faster per token (sensitivity)"
                                        if args.train_speed != 1 else ""))
    print("window | seconds | generation tokens/s with the fault | without | ratio")
    for name, a, b, with_, without in f.windows:
        print(f"{name} | {a:.0f}-{b:.0f} | {with_:,.0f} | {without:,.0f} | {ratio(with_, without)}")
    print(f"trained tokens/s after warm-up: {f.train_ratio:.3f}x the fault-free run's; the latest train step ended "
          f"{f.max_step_delay_s:.1f} s later (paper: training 'unaffected or ... a slight drop')")
    print(f"partial-response pool: {f.resumed} trajectories resumed on other engines, {f.tokens_kept:,} tokens "
          f"kept, {f.tokens_lost:,} lost ({f.tokens_lost / max(1, f.tokens_kept + f.tokens_lost):.1%}: generated "
          f"since each one's last stream); samples trained {f.samples[0]} vs {f.samples[1]}; none lost, every "
          f"group whole and trained once")
    print(f"the killed engines decode again {f.back_decoding_s:.0f} s after the kill (outage + weight load + "
          f"re-prefill; by construction of the 252 s input, not a result)")
    print(f"laminar §8.5: training throughput under a machine kill {f.train_ratio:.3f}x the fault-free run's, "
          f"generation during the outage {ratio(f.windows[1][3], f.windows[1][4])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

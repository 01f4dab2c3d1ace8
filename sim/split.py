"""StreamRL's profiler-based planning (§4.2) on the simulator: Algorithm 1's generation / training split, and the
generation-time profile that dynamic scale-out reads.

    python -m sim split --workload streamrl_20k --cost h800_streamrl_7b --gpus 32 --prompts 1024 --group-size 1

P_gen(x): the generation time of one round on x GPUs of engines, simulated with the preset's own dispatch (StreamRL's
skewness-aware dispatch: "generation time is also deterministic for a given workload" under it, §4.2): a
generation-only run of two rounds whose second round is measured (the first teaches the length ranker, as the
paper's ranker is trained before the run). P_train(y): the cost model's time to train one round's tokens (those the
profiling run generated) on y GPUs. Algorithm 1 (single datacenter) then picks x + y <= n minimising
max(P_gen(x), P_train(y)) (sched/policies/streamrl/resource_split.py `split_gpus`). x steps by `step` GPUs (a
multiple of the engines' TP; coarser steps trade resolution for simulation time), y by one GPU.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import sched
from sched.policies.streamrl.resource_split import Split, split_gpus
from sim.cost import CostModel
from sim.profiles import get_profile
from sim.run import simulate
from sim.workload import Workload, get_workload

PROFILE_TRAIN_GPUS = 10**4   # the profiling runs' trainer: fast enough never to hold generation back


@dataclass(frozen=True)
class GenProfile:
    """P_gen(x) for the engine counts profiled, and the tokens one round trains."""
    gpus_per_engine: int
    seconds: dict[int, float]      # generation GPUs -> seconds per round
    round_tokens: float

    def gen_time(self, gpus: int) -> float:
        return self.seconds.get(gpus, math.inf)


def generation_time(preset: str, workload: str | Workload, cost: str | CostModel, engines: int, prompts: int,
                    group_size: int, seed: int = 0, ranker_recall: float | None = None) -> tuple[float, float]:
    """(seconds to generate round 1, its trained tokens) on `engines` engines, round 0 being the ranker's warm-up;
    `ranker_recall`: simulate()'s (a simulated ranker of that recall, sim/ranker.py)."""
    r = simulate(sched.load_preset(preset), workload, cost, engines, PROFILE_TRAIN_GPUS, steps=2,
                 group_size=group_size, prompts_per_step=prompts, seed=seed, ranker_recall=ranker_recall)
    start = {e.data["round"]: e.t for e in r.events if e.kind == "round_started"}
    g_round = {e.group_id: e.data["round"] for e in r.events if e.kind == "group_materialized"}
    last = max(e.t for e in r.events if e.kind == "trajectory_finished" and g_round.get(e.group_id) == 1)
    tokens, call = 0.0, None
    for e in r.events:                     # the tokens of the train calls of round 1
        if e.kind == "train_started":
            call = e
        elif e.kind == "train_step_done" and call is not None:
            if any(g_round.get(g) == 1 for g in call.data["groups"]):
                tokens += e.data["tokens"]
            call = None
    return last - start[1], tokens


def profile(preset: str, workload: str | Workload, cost: str | CostModel, gpus: int, prompts: int, group_size: int,
            seed: int = 0, step: int = 0, ranker_recall: float | None = None) -> GenProfile:
    """P_gen over x = step, 2 step, ... < gpus generation GPUs (step: one engine by default)."""
    c = get_profile(cost)
    step = step or c.gpus_per_engine
    if step % c.gpus_per_engine:
        raise ValueError(f"step {step} is not a multiple of the engines' {c.gpus_per_engine} GPUs")
    seconds, tokens = {}, []
    for x in range(step, gpus, step):
        t, n = generation_time(preset, workload, c, x // c.gpus_per_engine, prompts, group_size, seed, ranker_recall)
        seconds[x] = t
        tokens.append(n)
    return GenProfile(c.gpus_per_engine, seconds, sum(tokens) / len(tokens))


def plan(prof: GenProfile, cost: str | CostModel, gpus: int) -> Split:
    """Algorithm 1 over the profile and the cost model's training time."""
    c = get_profile(cost)
    step = min(prof.seconds)
    return split_gpus(gpus, prof.gen_time, lambda y: c.train_s(prof.round_tokens, y), gen_unit=step)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim split", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--cost", required=True, help="cost profile (python -m sim profiles)")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs to split between generation and training")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--group-size", type=int, default=1)
    ap.add_argument("--preset", default="streamrl", help="whose dispatch generates (default: StreamRL's)")
    ap.add_argument("--step", type=int, default=0, help="generation GPUs between profiled points (default: one "
                                                         "engine)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        get_workload(args.workload)
        c = get_profile(args.cost)
    except ValueError as e:
        ap.error(str(e))
    if args.gpus < 2 * c.gpus_per_engine:
        ap.error(f"--gpus {args.gpus}: need room for an engine of {c.gpus_per_engine} GPUs and a trainer")
    prof = profile(args.preset, args.workload, c, args.gpus, args.prompts, args.group_size, args.seed, args.step)
    best = plan(prof, c, args.gpus)
    print(f"{'gen GPUs':>8} {'P_gen s':>9} {'train GPUs':>10} {'P_train s':>9}")
    for x, t in sorted(prof.seconds.items()):
        y = args.gpus - x
        print(f"{x:8d} {t:9.1f} {y:10d} {c.train_s(prof.round_tokens, y):9.1f}" + ("   <- Algorithm 1"
                                                                                     if x == best.gen else ""))
    rest = args.gpus - best.gen
    note = f"; {best.train} would reach the same iteration time" if best.train < rest else ""
    print(f"split: {best.gen} generation GPUs ({best.gen // c.gpus_per_engine} engines) + {rest} training GPUs{note}; "
          f"iteration {best.time:.1f} s (max of the two stages)")
    return 0

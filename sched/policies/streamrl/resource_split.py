"""Profiler-based resource splits of StreamRL, as pure functions over cost curves (profiled, or the simulator's
cost model). The `skewness` dispatch runs Algorithm 2 every round; the simulator's planner (sim/split.py) runs
Algorithm 1 over generation times it simulates and scale-out over the same profile.

- `split_gpus`: §4.2 Algorithm 1, single datacenter. With n GPUs, pick x for generation and y for training,
  x + y <= n, minimising the iteration time max(P_gen(x), P_train(y)) (the two stages overlap when streamed).
- `split_cross_dc`: Algorithm 1's cross-datacenter branch. Each stage gets its own datacenter (m and n GPUs); the
  faster stage under full allocation is shrunk "until both stages achieve similar execution times" (argmin |.|
  as printed; `safe=True` takes the smallest size that is not slower than the other stage, which never raises
  the iteration time).
- `should_scale_out`: §4.2 dynamic adjustment: add a generation unit when the measured gap t_gen - t_train is
  at least what one more unit would save (and it saves something).
- `split_instances`: §5.3 Algorithm 2: how many of N generation instances serve the predicted long tail (the top
  alpha of prompts, at length L_a = P90 of recent lengths) vs the rest (at L_r = P50), minimising the sum of the
  two classes' latencies (as printed; `objective="max"` for the makespan), each by Eq. 2:
  PTL(BS) x L x ceil(M / BS) with M prompts per instance and BS = min(M, max_bs(L)); that BS is the long-tail
  instances' "smaller batch size" (§5.1).
Units (`gen_unit`, `train_unit`) are the smallest allocations (a TP group, a data-parallel replica).
Ties go to fewer GPUs, then to fewer generation GPUs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

Curve = Callable[[int], float]   # GPUs -> seconds
PTL = Callable[[int, float], float]   # (batch size, output length) -> seconds per token (Eq. 1's PTL(BS); a profile
#                                       that ignores the length is context-free, as Eq. 1 prints it)


@dataclass(frozen=True)
class Split:
    gen: int
    train: int
    time: float                  # the predicted iteration time max(P_gen, P_train)


def split_gpus(n_gpus: int, gen_time: Curve, train_time: Curve, gen_unit: int = 1, train_unit: int = 1) -> Split:
    gen = {x: gen_time(x) for x in range(gen_unit, n_gpus + 1, gen_unit)}
    train = {y: train_time(y) for y in range(train_unit, n_gpus + 1, train_unit)}
    best = None
    for x, tg in gen.items():
        for y, tt in train.items():
            if x + y <= n_gpus and (best is None or (max(tg, tt), x + y, x) < (best.time, best.gen + best.train,
                                                                              best.gen)):
                best = Split(x, y, max(tg, tt))
    if best is None:
        raise ValueError(f"{n_gpus} GPUs cannot hold one generation unit ({gen_unit}) and one training unit "
                         f"({train_unit})")
    return best


def _shrink(limit: int, unit: int, curve: Curve, target: float, safe: bool) -> int:
    sizes = list(range(unit, limit + 1, unit))
    if safe:
        return next((k for k in sizes if curve(k) <= target), sizes[-1])
    return min(sizes, key=lambda k: (abs(curve(k) - target), k))


def split_cross_dc(m_gen: int, n_train: int, gen_time: Curve, train_time: Curve, gen_unit: int = 1,
                   train_unit: int = 1, safe: bool = False) -> Split:
    tg, tt = gen_time(m_gen), train_time(n_train)
    if tg < tt:
        k = _shrink(m_gen, gen_unit, gen_time, tt, safe)
        return Split(k, n_train, max(gen_time(k), tt))
    k = _shrink(n_train, train_unit, train_time, tg, safe)
    return Split(m_gen, k, max(tg, train_time(k)))


def should_scale_out(t_gen: float, t_train: float, gen_time: Curve, gen_gpus: int, unit: int) -> bool:
    """delta = t_gen - t_train >= delta' = gen_time(x) - gen_time(x + unit), with generation the slower stage and
    the unit actually saving time (our reading: where the profile is flat, delta' = 0 and the printed rule would
    add units that change nothing)."""
    saved = gen_time(gen_gpus) - gen_time(gen_gpus + unit)
    return t_gen > t_train and saved > 0 and t_gen - t_train >= saved


def quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def batch_size(n_prompts: int, length: float, instances: int, max_bs: Callable[[float], int]) -> int:
    """Eq. 2's BS for one class spread evenly over `instances`: min(M, BS_max(L)), M = its prompts per instance."""
    return max(1, min(math.ceil(n_prompts / instances), max_bs(length)))


def instance_latency(n_prompts: int, length: float, instances: int, ptl: PTL,
                     max_bs: Callable[[float], int]) -> float:
    """Eq. 2 for one class: its prompts spread evenly over `instances`, PTL(BS) x L x ceil(M / BS)."""
    if n_prompts == 0:
        return 0.0
    m = math.ceil(n_prompts / instances)
    bs = batch_size(n_prompts, length, instances, max_bs)
    return ptl(bs, length) * length * math.ceil(m / bs)


@dataclass(frozen=True)
class InstanceSplit:
    long: int                    # N_l: instances for the predicted long tail
    regular: int                 # N_r
    long_batch: int              # Eq. 2's BS on a long-tail instance: its batch cap (0: no long tail)
    long_length: float           # L_a = P90 of the recent lengths
    regular_length: float        # L_r = P50


def split_instances(est_lengths: Sequence[float], n_instances: int, ptl: PTL, max_bs: Callable[[float], int],
                    alpha: float = 0.2, recent_lengths: Sequence[float] | None = None,
                    objective: str = "sum") -> InstanceSplit:
    """Algorithm 2: (N_l, N_r) minimising the two classes' Eq. 2 latencies combined by `objective`, and the long
    tail's batch size; no long-tail instance when there is no tail or only one instance."""
    n_long = math.ceil(alpha * len(est_lengths) - 1e-9)
    dist = list(recent_lengths) if recent_lengths else list(est_lengths)
    l_a, l_r = (quantile(dist, 0.9), quantile(dist, 0.5)) if dist else (0.0, 0.0)
    if n_instances < 2 or n_long == 0 or n_long == len(est_lengths):
        return InstanceSplit(0, n_instances, 0, l_a, l_r)
    combine = {"sum": lambda a, b: a + b, "max": max}[objective]
    best = min(range(1, n_instances), key=lambda nl: (
        combine(instance_latency(n_long, l_a, nl, ptl, max_bs),
                instance_latency(len(est_lengths) - n_long, l_r, n_instances - nl, ptl, max_bs)), nl))
    return InstanceSplit(best, n_instances - best, batch_size(n_long, l_a, best, max_bs), l_a, l_r)

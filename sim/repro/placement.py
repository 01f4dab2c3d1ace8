"""One placement rule for every disaggregated system of a comparison: the GPU split that balances generation and
training throughput.

StaleFlow §6.1 tunes every system's split "to optimal values", Laminar §8.1 "by matching the generation and training
throughput", StreamRL §4.2 (Algorithm 1) picks the split minimising the slower stage's time: the same rule, applied
here the same way to every system, each on its own run. `balanced_split` measures each stage's work on a run at a
starting split (the rollout stage used W_gen = rollout GPUs x makespan x (1 - engine idle ratio) GPU-seconds, the
trainer W_train = train GPUs x its compute seconds) and re-divides the GPUs in proportion, x = total x W_gen /
(W_gen + W_train) rollout GPUs, rounded to a node and kept one node away from either end. Assumption: a stage's
GPU-seconds per trained batch do not change with its GPU count (linear scaling); the long tail and a per-engine
batch break it, so a reproduction may also simulate the starting split and keep the faster (StaleFlow's
`tuned_split`, Laminar's `lm_split`), which is the same search for every system. `per_sample_balanced_split` counts
the rollout stage's work per trained sample, for systems whose unbounded buffer lets the engines run ahead of the
trainer (Laminar, AReaL at unbounded staleness: every GPU is busy at any split, so the plain rule keeps it).
"""
from __future__ import annotations

from dataclasses import replace

from sim.repro.core import Setting
from sim.repro.figures import of
from sim.run import SimResult


def balanced_split(r: SimResult, s: Setting, total_gpus: int, node: int, gpus_per_engine: int = 1) -> Setting:
    """`s` with its GPUs re-divided between rollout and training in proportion to the two stages' work measured on
    `r` (a run at `s`; module docstring): x rollout GPUs, a multiple of `node` (itself a multiple of
    gpus_per_engine) in [node, total_gpus - node]; engines = x / gpus_per_engine, train GPUs = total - x."""
    if node % gpus_per_engine:
        raise ValueError(f"a node of {node} GPUs does not hold whole engines of {gpus_per_engine}")
    m = r.metrics
    w_gen = s.num_engines * gpus_per_engine * m["makespan_s"] * (1.0 - m["engine_idle_ratio"])
    w_train = s.train_gpus * m["train_compute_s"]
    return _divide(s, w_gen, w_train, total_gpus, node, gpus_per_engine)


def per_sample_balanced_split(r: SimResult, s: Setting, total_gpus: int, node: int,
                              gpus_per_engine: int = 1) -> Setting:
    """`balanced_split` with the rollout stage's work counted per trained sample: W_gen x trained / generated
    samples. A system whose buffer lets the engines run ahead of the trainer (an unbounded experience buffer,
    unbounded staleness) keeps every GPU busy at any split, so `balanced_split` would read its over-generation as
    work the trainer needs and keep the split; counted per sample, generation and training *throughputs* are
    matched (Laminar §8.1's wording). Equal to `balanced_split` when the run trains every sample it generates."""
    if node % gpus_per_engine:
        raise ValueError(f"a node of {node} GPUs does not hold whole engines of {gpus_per_engine}")
    m = r.metrics
    generated = len(of(r, "trajectory_finished"))
    trained = m["samples_trained"]
    if not generated or not trained:
        raise RuntimeError(f"{r.preset}: nothing generated or trained, no split to balance")
    w_gen = s.num_engines * gpus_per_engine * m["makespan_s"] * (1.0 - m["engine_idle_ratio"]) * trained / generated
    w_train = s.train_gpus * m["train_compute_s"]
    return _divide(s, w_gen, w_train, total_gpus, node, gpus_per_engine)


def _divide(s: Setting, w_gen: float, w_train: float, total_gpus: int, node: int, gpus_per_engine: int) -> Setting:
    """x = total x W_gen / (W_gen + W_train) rollout GPUs, rounded to a node, kept a node from either end."""
    x = round(total_gpus * w_gen / (w_gen + w_train) / node) * node
    x = min(total_gpus - node, max(node, x))
    return replace(s, num_engines=x // gpus_per_engine, train_gpus=total_gpus - x)

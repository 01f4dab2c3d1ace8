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
`tuned_split`), which is the same search for every system.
"""
from __future__ import annotations

from dataclasses import replace

from sim.repro.core import Setting
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
    x = round(total_gpus * w_gen / (w_gen + w_train) / node) * node
    x = min(total_gpus - node, max(node, x))
    return replace(s, num_engines=x // gpus_per_engine, train_gpus=total_gpus - x)

"""Strict staleness control, weight half: global version sync with partial rollout (AReaL / VeRL-Async): every
engine adopts each published version as soon as it appears, busy or not; its running sequences keep their
tokens and continue under the new weights after a KV recompute (the engine's in-place load). No interrupt to a
trajectory store, no migration: trajectories stay on the engine they started on.

Invariant kept: engines move only to published, newer versions; a trajectory's oldest token version is the
version it started under, which is what the `areal` dispatch and hand-off bound.
"""
from __future__ import annotations

from sched.base import LoadWeights, Views, WeightSync, register


@register
class ArealSync(WeightSync):
    name = "areal"

    def engines_to_load(self, v: Views) -> list[LoadWeights]:
        ps = v.trainer.published
        return [LoadWeights(e.engine, ps) for e in v.engines if e.version < ps and not e.loading]

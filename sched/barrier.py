"""Barrier weight sync: an engine adopts the latest published version as soon as it has nothing in flight
(the synchronous baseline; with synchronous intake no round starts before every engine has adopted it).

Invariant kept: an engine never changes weights under a running trajectory, so each trajectory is generated
under exactly one version.
"""
from __future__ import annotations

from sched.base import LoadWeights, Views, WeightSync, register


@register
class Barrier(WeightSync):
    name = "barrier"

    def engines_to_load(self, v: Views) -> list[LoadWeights]:
        latest = v.trainer.published
        return [LoadWeights(e.engine, latest) for e in v.engines
                if e.version < latest and not e.loading and e.assigned == 0]

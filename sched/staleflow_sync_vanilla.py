"""StaleFlow's vanilla synchronization (§6.5 ablation): "An instance synchronizes the model immediately once a
newer version is observed at the PS" — Interrupt everything on it (back to the TS, partial rollout), then
LoadWeights of the newest published version. Event-driven (no coordination period).

Invariant kept: an instance only moves to a newer, published version; V_traj of interrupted trajectories kept.
"""
from __future__ import annotations

from dataclasses import dataclass

from config import F
from sched.base import Interrupt, LoadWeights, Views, WeightSync, register
from sched.staleflow_state import Member, held_by_engine


@register
class VanillaSync(Member, WeightSync):
    name = "staleflow_vanilla"

    @dataclass
    class Params:
        eta: int = F(3, ge=0, help="staleness bound (the same eta as the other StaleFlow tables)")

    def engines_to_load(self, v: Views) -> list[LoadWeights | Interrupt]:
        ps = v.trainer.published
        lagging = [e.engine for e in v.engines if e.version < ps and not e.loading]
        if not lagging:
            return []
        held = held_by_engine(v, self.state(v))
        out: list[LoadWeights | Interrupt] = []
        for e in lagging:
            ids = [i for i in held[e] if v.requests[i].state == "running"]
            if ids:
                out.append(Interrupt(e, ids))
            out.append(LoadWeights(e, ps))
        return out

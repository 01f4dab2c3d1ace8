"""StaleFlow synchronization: Algorithm 4 (§5.3) with Algorithm 1's effect, per instance.

On a coordination pass, with the parameter store (each rollout rank's relay) at version ps:
  1. eligible: the instance lags (ps > inst_version) and "cannot accept additional load without
     synchronization": no TS trajectory is routable to it (Alg. 2 at its current version);
  2. selected: a tentative plan of the ACTIVE routing strategy (the one the preset's dispatch registered in the
     shared state) on the snapshot with only this instance moved to ps (its running trajectories kept in the
     gain, as Alg. 4 does) places at least one TS trajectory on it.
A selected instance gets Interrupt(every trajectory on it) then LoadWeights(ps) (the paper's Pull): its partial
trajectories go back to the TS with their V_traj and tokens, and routing re-places them (MLQ priority) once the
interrupts land. An instance without weights yet loads at once. Contrast (§6.5): vanilla sync updates every
instance as soon as a version appears; this one "synchronizes per instance based on actual load".

Invariant kept: an instance only ever moves to a newer, published version; a trajectory's V_traj is untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from config import F
from sched.base import Interrupt, LoadWeights, Views, WeightSync, register
from sched.staleflow_state import Member, coordinating, fold, snapshots
from sched.staleflow_store import TSSummary, ts_items


@register
class StaleFlowSync(Member, WeightSync):
    name = "staleflow"

    @dataclass
    class Params:
        eta: int = F(3, ge=0, help="staleness bound (the same eta as the other StaleFlow tables)")
        period_s: float = F(1.0, ge=0, help="coordination period (the same as the routing's)")
        block_size: int = F(16, ge=1, help="tokens per KV block in the engines' reports")

    def engines_to_load(self, v: Views) -> list[LoadWeights | Interrupt]:
        st = self.state(v)
        ps = v.trainer.published
        if ps < 0:
            return []
        out: list[LoadWeights | Interrupt] = [LoadWeights(e.engine, ps) for e in v.engines
                                              if e.version < 0 and not e.loading]
        lagging = [e for e in v.engines if 0 <= e.version < ps and not e.loading]
        if not lagging or not coordinating(v, st, self.p.period_s):
            return out
        if st.planner is None:
            raise ValueError("staleflow sync needs a StaleFlow routing dispatch (staleflow or staleflow_vanilla)")
        fold(v, st)
        snaps = snapshots(v, st, self.p.block_size, float("inf"))
        items = ts_items(v, st)
        ts = TSSummary(st.buffers, items)
        for e in lagging:
            if ts.any_routable(snaps[e.engine]):
                continue                                    # it can still take load at its version
            tmp = dict(snaps)
            tmp[e.engine] = replace(snaps[e.engine], version=ps)
            if any(i == e.engine for i, _ in st.planner(tmp, items, st.buffers.copy(), until=e.engine)):
                if snaps[e.engine].held:
                    out.append(Interrupt(e.engine, list(snaps[e.engine].held)))
                out.append(LoadWeights(e.engine, ps))
        return out

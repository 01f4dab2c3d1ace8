"""StaleFlow synchronization: Algorithm 4 (§5.3) with Algorithm 1's effect, per instance; and its vanilla
ablation (§6.5)."""
from __future__ import annotations

from dataclasses import replace

from sched.base import Preset, WeightSync, register
from sched.decisions import Interrupt, LoadWeights
from sched.policies.staleflow.dispatch import StaleFlowRouting
from sched.policies.staleflow.state import Snaps
from sched.policies.staleflow.store import TSQueue, TSSummary
from sched.views import RequestState, Views


def staleflow_routing(preset: Preset, who: str) -> StaleFlowRouting:
    """The preset's StaleFlow routing dispatch, which owns the design's parameters and state."""
    if not isinstance(preset.dispatch, StaleFlowRouting):
        raise ValueError(f"{who} needs a StaleFlow routing dispatch (staleflow or staleflow_vanilla), which holds "
                         f"the design's parameters and staleness buffers; this preset's dispatch is "
                         f"{preset.dispatch.name!r}")
    return preset.dispatch


@register
class StaleFlowSync(WeightSync):
    """On a coordination pass, with the parameter store (each rollout rank's relay) at version ps:
      1. eligible: the instance lags (ps > inst_version) and "cannot accept additional load without
         synchronization": no TS trajectory is routable to it (Alg. 2 at its current version);
      2. selected: a tentative plan of the preset's routing strategy on the snapshot with only this instance moved
         to ps (its running trajectories kept in the gain, as Alg. 4 does) places at least one TS trajectory on it.
    A selected instance gets Interrupt(every trajectory on it) then LoadWeights(ps) (the paper's Pull): its partial
    trajectories go back to the TS with their V_traj and tokens, and routing re-places them (MLQ priority) once the
    interrupts land. An instance without weights yet loads at once. Contrast (§6.5): vanilla sync updates every
    instance as soon as a version appears; this one "synchronizes per instance based on actual load".

    Invariant kept: an instance only ever moves to a newer, published version; a trajectory's V_traj is untouched."""
    name = "staleflow"
    paper = "StaleFlow §5.3, Algorithm 4 (per-instance synchronization)"

    def bind(self, preset: Preset) -> None:
        self.routing = staleflow_routing(preset, f"the {self.name!r} weight sync")
        self.routing.state.steps["sync"] = self.plan

    def engines_to_load(self, v: Views) -> list[LoadWeights | Interrupt]:
        ps = v.trainer.published
        out: list[LoadWeights | Interrupt] = [LoadWeights(e.engine, ps) for e in v.engines
                                              if e.version < 0 and not e.loading and ps >= 0]
        return out + self.routing.state.take(v, "sync")

    def plan(self, v: Views, snaps: Snaps) -> list[LoadWeights | Interrupt]:
        """Algorithm 4 on the pass's snapshot (Algorithm 1's first step)."""
        st = self.routing.state
        ps = v.trainer.published
        lagging = [e for e in v.engines if 0 <= e.version < ps and not e.loading]
        if not lagging:
            return []
        buffers = st.buffers(v)
        items = TSQueue(v, buffers, st.aborts.dropping)
        ts = TSSummary(buffers, items)
        out: list[LoadWeights | Interrupt] = []
        for e in lagging:
            if ts.any_routable(snaps[e.engine]):
                continue                                    # it can still take load at its version
            tmp = dict(snaps)
            tmp[e.engine] = replace(snaps[e.engine], version=ps)
            if any(i == e.engine for i, _ in self.routing.route(tmp, items, buffers.copy(), until=e.engine)):
                if snaps[e.engine].requests:
                    out.append(Interrupt(e.engine, list(snaps[e.engine].requests)))
                out.append(LoadWeights(e.engine, ps))
        return out


@register
class VanillaSync(StaleFlowSync):
    """The §6.5 ablation: "An instance synchronizes the model immediately once a newer version is observed at the
    PS": Interrupt everything running on it (back to the TS, partial rollout), then LoadWeights of the newest
    published version. Event-driven (no coordination period)."""
    name = "staleflow_vanilla"
    paper = "StaleFlow §6.5 ablation: vanilla synchronization (immediate)"

    def engines_to_load(self, v: Views) -> list[LoadWeights | Interrupt]:
        st = self.routing.state
        return st.take(v, "sync") if st.coordinating(v) else self.plan(v, {})

    def plan(self, v: Views, snaps: Snaps) -> list[LoadWeights | Interrupt]:
        """Every lagging instance: Interrupt what runs on it, then Pull (also Algorithm 1's first step on a pass,
        so routing never places a trajectory on an instance this sync empties)."""
        ps = v.trainer.published
        lagging = [e.engine for e in v.engines if e.version < ps and not e.loading]
        if not lagging:
            return []
        on = self.routing.state.on_engine(v)
        out: list[LoadWeights | Interrupt] = []
        for e in lagging:
            ids = [r.req_id for r in on[e] if r.state == RequestState.RUNNING]
            if ids:
                out.append(Interrupt(e, ids))
            out.append(LoadWeights(e, ps))
        return out

"""StaleFlow's synchronization strategy: Algorithm 4 (§5.3, App. D), per instance, and its vanilla ablation (§6.5).

Both are parts of the StaleFlow design (algorithm1.py): `select` is the SynchronizationStrategy of Algorithm 1's
line 4, which then interrupts everything on each selected instance and has it Pull (lines 5-8). `unpaced` is what
the weight sync issues on every decision round, pass or not: an instance without weights loads at once; the vanilla
sync, event-driven, syncs every lagging instance at once between passes.

Invariant kept: an instance only ever moves to a newer, published version; a trajectory's V_traj is untouched (its
tokens so far go back to the TS with it and resume on an instance at least as new).
"""
from __future__ import annotations

from dataclasses import replace

from sched.base import Preset, WeightSync, register
from sched.decisions import Interrupt, LoadWeights
from sched.policies.staleflow.buffers import StalenessBuffers
from sched.policies.staleflow.routing import Route
from sched.policies.staleflow.state import Snaps, StaleFlowState, design_state
from sched.policies.staleflow.store import TSQueue, TSSummary
from sched.views import RequestState, Views


@register
class StaleFlowSync(WeightSync):
    """Algorithm 4, with the parameter store (each rollout rank's relay) at version ps:
      1. eligible: the instance lags (ps > inst_version) and "cannot accept additional load without
         synchronization": no TS trajectory is routable to it (Alg. 2 at its current version);
      2. selected: a tentative plan of the preset's routing strategy on the snapshot with only this instance moved
         to ps (its running trajectories kept in the gain, as Alg. 4 does) places at least one TS trajectory on it.
    Contrast (§6.5): vanilla sync updates every instance as soon as a version appears; this one "synchronizes per
    instance based on actual load"."""
    name = "staleflow"
    paper = "StaleFlow §5.3, Algorithm 4 (per-instance synchronization)"

    def bind(self, preset: Preset) -> None:
        design_state(preset, f"the {self.name!r} weight sync")     # a part of the design its dispatch is

    def select(self, S: Snaps, ts: TSQueue, buffers: StalenessBuffers, ps: int, route: Route) -> list[int]:
        """The instances to synchronize now (Algorithm 4), in engine order."""
        lagging = [e for e, s in S.items() if 0 <= s.version < ps and not s.loading]
        if not lagging:
            return []
        summary = TSSummary(buffers, ts)
        out = []
        for e in lagging:
            if summary.any_routable(S[e]):                          # Step 1: it can still take load at its version
                continue
            tmp = dict(S)                                           # Step 2: a tentative update, this instance only
            tmp[e] = replace(S[e], version=ps)
            if any(i == e for i, _ in route(tmp, ts, buffers.copy(), until=e)):
                out.append(e)
        return out

    def unpaced(self, v: Views, st: StaleFlowState, passing: bool) -> list[LoadWeights | Interrupt]:
        """Every round: an instance without weights yet loads the published version at once."""
        ps = v.trainer.published
        return [LoadWeights(e.engine, ps) for e in v.engines if e.version < 0 and not e.loading and ps >= 0]


@register
class VanillaSync(StaleFlowSync):
    """The §6.5 ablation: "An instance synchronizes the model immediately once a newer version is observed at the
    PS": Interrupt everything running on it (back to the TS, partial rollout), then LoadWeights of the newest
    published version. Event-driven: between passes at once; on a pass as Algorithm 1's sync step, so routing never
    places a trajectory on an instance this sync empties."""
    name = "staleflow_vanilla"
    paper = "StaleFlow §6.5 ablation: vanilla synchronization (immediate)"

    def select(self, S: Snaps, ts: TSQueue, buffers: StalenessBuffers, ps: int, route: Route) -> list[int]:
        return [e for e, s in S.items() if s.version < ps and not s.loading]

    def unpaced(self, v: Views, st: StaleFlowState, passing: bool) -> list[LoadWeights | Interrupt]:
        """Between passes, what Algorithm 1's lines 4-6 would issue for `select`, read from the views."""
        ps = v.trainer.published
        lagging = [e.engine for e in v.engines if e.version < ps and not e.loading]
        if passing or not lagging:
            return []
        on = st.on_engine(v)
        out: list[LoadWeights | Interrupt] = []
        for e in lagging:
            ids = [r.req_id for r in on[e] if r.state == RequestState.RUNNING]
            if ids:
                out.append(Interrupt(e, ids))
            out.append(LoadWeights(e, ps))
        return out

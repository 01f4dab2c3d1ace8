"""StaleFlow routing: Algorithms 2-3 (§5.3), the multi-level queue + waterfall + cost-model marginal gain, and its
vanilla ablation (§6.5). The routing dispatch owns the design's shared state (state.py)."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import Dispatch, register
from sched.decisions import RoundPlan, Submit
from sched.policies.staleflow.buffers import StalenessBuffers
from sched.policies.staleflow.cost import InstanceSnap, ThroughputModel
from sched.policies.staleflow.state import StaleFlowParams, StaleFlowState
from sched.policies.staleflow.store import Item, TSQueue, commit, routable, ts_intake
from sched.views import Views


def marginal_routes(snaps: dict[int, InstanceSnap], items: Iterable[Item], buffers: StalenessBuffers,
                    model: ThroughputModel, mu: float, until: int | None = None) -> list[tuple[int, Item]]:
    """Alg. 3 on a snapshot (mutated copy) and buffers (mutated: pass a copy for a tentative plan). `until`: stop
    at the first trajectory routed to that instance (Alg. 4 only asks whether there is one)."""
    snaps = dict(snaps)
    # Alg. 2 per instance (routable()) depends only on the instance's version: candidates are grouped by version
    # (instances without weights or mid-Pull take nothing), and each trajectory asks once per distinct version.
    by_ver: dict[int, list[int]] = {}
    for e in sorted(snaps):
        if snaps[e].version >= 0 and not snaps[e].loading:
            by_ver.setdefault(snaps[e].version, []).append(e)
    versions = sorted(by_ver)
    out: list[tuple[int, Item]] = []
    for it in items:
        ok = [u for u in versions if routable(buffers, it, snaps[by_ver[u][0]])]
        if not ok:
            break                                   # head-of-line: lower queues wait for this one
        L = it.length
        floor = mu * model.ideal_gain(L)
        chosen = None
        for ver in ok:
            gain, best = model.best_gain([snaps[e] for e in by_ver[ver]], L)
            if gain >= floor and model.fits(best, L):
                chosen = best
                break
        if chosen is None:
            break                                   # withheld: no instance gains enough now
        commit(buffers, it, chosen.version)
        snaps[chosen.engine] = model.after_route(chosen, L)
        out.append((chosen.engine, it))
        if until is not None and chosen.engine == until:
            break
    return out


def fewest_routes(snaps: dict[int, InstanceSnap], items: Iterable[Item], buffers: StalenessBuffers,
                  until: int | None = None) -> list[tuple[int, Item]]:
    """The vanilla routing: each TS trajectory to the instance with the fewest trajectories. When that instance is
    mid-Pull, the Route waits for the Pull to land (§5.2), so the trajectory and the queue behind it wait for a
    later pass instead of piling onto the instances that already pulled (after a vanilla sync every instance pulls
    at once, and the first to land would otherwise take the whole store)."""
    load = {e: s.running + s.waiting for e, s in snaps.items()}
    out: list[tuple[int, Item]] = []
    for it in items:
        cands = [s for s in snaps.values() if routable(buffers, it, s)]
        if not cands:
            break                                   # MLQ head-of-line, as in Alg. 3
        chosen = min(cands, key=lambda s: (load[s.engine], s.engine))
        if any(s.loading and s.version >= 0 and load[s.engine] < load[chosen.engine] for s in snaps.values()):
            break                                   # the least-loaded instance is mid-Pull: wait for it
        commit(buffers, it, chosen.version)
        load[chosen.engine] += 1
        out.append((chosen.engine, it))
        if until is not None and chosen.engine == until:
            break
    return out


@register
class StaleFlowRouting(Dispatch):
    """TS trajectories are taken in MLQ order: smaller V_traj first ("higher staleness and thus higher routing
    priority"), unrouted members of an already reserved group at their group's version, initial trajectories of new
    groups last; FIFO within a queue. For each, the candidate instances are those Alg. 2 admits (an initial
    trajectory: the staleness manager can reserve for the instance's version; a partial one: instance version >=
    its V_traj and its newest token's). Candidates are visited by ascending version ("instances with a smaller
    version should be prioritized, as they admit fewer feasible routing options"); in each version group the one
    with the largest marginal gain dT_i (Eq. 3) is chosen if dT_i >= mu x dT_ideal (Eq. 4); otherwise the next
    group is tried, and if none qualifies the trajectory and everything behind it is withheld until a later pass
    ("allowing ongoing workloads on these instances to complete"). Each route updates the snapshot (S' of Eq. 3)
    and the staleness buffers (Reserve for a group's first member, join for later ones) within the pass.
    Intake: the TS keeps `ts_groups` unreserved groups waiting.

    Invariant kept: nothing is admitted that the staleness manager did not reserve for: every routed trajectory's
    group holds an entry with V + eta >= V_buf."""
    name = "staleflow"
    paper = "StaleFlow §5.3, Algorithms 2-3 (MLQ, waterfall, marginal gain)"
    reads_progress = True   # the snapshot's estimate of an engine whose report predates a command (state.py)

    def counters_period_s(self) -> float:
        """The snapshot is taken every coordination pass (Fig. 11): the engines report at that period."""
        return self.p.period_s

    @dataclass
    class Params(StaleFlowParams):
        mu: float = F(0.3, ge=0, help="route only if the marginal gain is at least mu x the ideal gain (§6.1)")

    def __init__(self, params: Any = None):
        super().__init__(params)
        self.state = StaleFlowState(self.p)

    def staleness_bound(self) -> int | None:
        return self.p.eta

    def kv_budget(self) -> float:
        """M for an instance that has not reported its KV size."""
        return self.p.cost.kv_budget_tokens or math.inf

    def route(self, snaps: dict[int, InstanceSnap], items: Iterable[Item], buffers: StalenessBuffers,
              until: int | None = None) -> list[tuple[int, Item]]:
        return marginal_routes(snaps, items, buffers, self.state.model, self.p.mu, until)

    def intake(self, v: Views) -> int | RoundPlan:
        st = self.state
        n = ts_intake(v, st.buffers(v), self.p.ts_groups) if st.coordinating(v) else 0
        G = st.aborts.group_size(v.group_size)
        return RoundPlan(fresh=n, group_size=G) if n and G > v.group_size else n

    def admit(self, v: Views) -> list[Submit]:
        st = self.state
        if not st.coordinating(v):
            return []
        st.sync_buffers(v)
        buffers = st.buffers(v)
        snaps = st.coordinate(v, st.snapshots(v, self.kv_budget()))     # Alg. 1: sync, migrate, then route
        routes = self.route(snaps, TSQueue(v, buffers, st.aborts.dropping), buffers)
        out: dict[int, list[int]] = {}
        for eng, it in routes:
            out.setdefault(eng, []).append(it.req.req_id)
            st.routed.add(it.req.req_id)
        return [Submit(e, ids) for e, ids in sorted(out.items())]

    def stats(self) -> dict[str, float]:
        """Eq. 1's snapshots: engine reports accepted, replaced by the estimate (they predated a command), and
        empty instances mid-Pull (exact without a report; not in the accepted share); the staleness manager's
        counts."""
        st = self.state
        n = st.snaps_accepted + st.snaps_estimated
        out = {"snapshots_accepted": st.snaps_accepted, "snapshots_estimated": st.snaps_estimated,
               "snapshots_empty_pull": st.snaps_empty_pull}
        if st.aborts.on:
            out.update(st.aborts.counts)
        return {**out, "snapshots_accepted_frac": st.snaps_accepted / n} if n else out

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)


@register
class VanillaRouting(StaleFlowRouting):
    """The §6.5 ablation: "Trajectories are assigned purely by load balancing their counts. Each trajectory in TS
    is routed to the instance with the fewest trajectories." Same TS, MLQ order and staleness check (a bound is a
    bound), but no cost model and no withholding: everything the staleness manager admits is routed at once. With
    vanilla sync and no migration this is the strict-staleness regime the paper says matches VeRL-Async."""
    name = "staleflow_vanilla"
    paper = "StaleFlow §6.5 ablation: vanilla routing (fewest trajectories)"
    Params = StaleFlowParams

    def kv_budget(self) -> float:
        return math.inf

    def route(self, snaps: dict[int, InstanceSnap], items: Iterable[Item], buffers: StalenessBuffers,
              until: int | None = None) -> list[tuple[int, Item]]:
        return fewest_routes(snaps, items, buffers, until)

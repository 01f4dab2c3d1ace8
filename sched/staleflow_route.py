"""StaleFlow routing: Algorithms 2-3 (§5.3), the multi-level queue + waterfall + cost-model marginal gain.

TS trajectories are taken in MLQ order: smaller V_traj first ("higher staleness and thus higher routing
priority"), unrouted members of an already reserved group at their group's version, initial trajectories of new
groups last; FIFO within a queue. For each, the candidate instances are those Alg. 2 admits (an initial
trajectory: the staleness manager can reserve for the instance's version; a partial one: instance version >=
its V_traj and its newest token's). Candidates are visited by ascending version ("instances with a smaller
version should be prioritized, as they admit fewer feasible routing options"); in each version group the one
with the largest marginal gain dT_i (Eq. 3) is chosen if dT_i >= mu x dT_ideal (Eq. 4); otherwise the next
group is tried, and if none qualifies the trajectory and everything behind it is withheld until a later pass
("allowing ongoing workloads on these instances to complete"). Each route updates the snapshot (S' of Eq. 3)
and the staleness buffers (Reserve for a group's first member, join for later ones) within the pass.
Intake: the TS keeps `ts_groups` unreserved groups waiting (sched/staleflow_state.py).

Invariant kept: nothing is admitted that the staleness manager did not reserve for: every routed trajectory's
group holds an entry with V + eta >= V_buf.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from config import F
from sched.base import Dispatch, Submit, Views, register
from sched.staleflow_cost import CostModel, InstanceSnap
from sched.staleflow_state import Item, Member, coordinating, cost_model, fold, snapshots
from sched.staleflow_store import commit, ts_intake, ts_items
from sched.staleness import StalenessBuffers


def marginal_plan(snaps: dict[int, InstanceSnap], items: Iterable[Item], buffers: StalenessBuffers, cost: CostModel,
                  mu: float, until: int | None = None) -> list[tuple[int, Item]]:
    """Alg. 3 on a snapshot (mutated copy) and buffers (mutated: pass a copy for a tentative plan). `until`: stop
    at the first trajectory routed to that instance (Alg. 4 only asks whether there is one)."""
    snaps = dict(snaps)
    out: list[tuple[int, Item]] = []
    for it in items:
        # Alg. 2 per instance; its answer depends only on the instance's version (and loading), so ask the
        # staleness manager once per distinct version: candidates grouped by version.
        by_ver: dict[int, list[InstanceSnap]] = {}
        ok: dict[int, bool] = {}
        for s in snaps.values():
            if s.version < 0 or s.loading:
                continue
            a = ok.get(s.version)
            if a is None:
                a = ok[s.version] = buffers.admits(it.req.group_id, s.version) if it.initial \
                    else s.version >= it.need
            if a:
                by_ver.setdefault(s.version, []).append(s)
        if not by_ver:
            break                                   # head-of-line: lower queues wait for this one
        L = it.length
        floor = mu * cost.ideal_gain(L)
        chosen = None
        for ver in sorted(by_ver):
            gain, _, best = max((cost.marginal_gain(s, L), -s.engine, s) for s in by_ver[ver])
            if gain >= floor and cost.fits(best, L):
                chosen = best
                break
        if chosen is None:
            break                                   # withheld: no instance gains enough now
        commit(buffers, it, chosen.version)
        snaps[chosen.engine] = cost.after_route(chosen, L)
        out.append((chosen.engine, it))
        if until is not None and chosen.engine == until:
            break
    return out


def submits(routes: list[tuple[int, Item]], held: set[int]) -> list[Submit]:
    out: dict[int, list[int]] = {}
    for eng, it in routes:
        out.setdefault(eng, []).append(it.req.req_id)
        held.add(it.req.req_id)
    return [Submit(e, ids) for e, ids in sorted(out.items())]


@register
class StaleFlowRouting(Member, Dispatch):
    name = "staleflow"

    @dataclass
    class Params:
        eta: int = F(3, ge=0, help="staleness bound: trainer version - V_traj at consumption (§4.2)")
        mu: float = F(0.3, ge=0, help="route only if the marginal gain is at least mu x the ideal gain (§6.1)")
        period_s: float = F(1.0, ge=0, help="coordination period: Algorithm 1 runs at most this often")
        ts_groups: int = F(0, ge=0, help="trajectory-store capacity in unreserved groups (0: (eta + 1) x batch)")
        block_size: int = F(16, ge=1, help="tokens per KV block in the engines' reports")
        cost: dict[str, float] = F({}, help="cost model coefficients k1..k5, kv_budget_tokens (default Table 4)")

    def __init__(self, params: "StaleFlowRouting.Params | None" = None):
        super().__init__(params)
        self.cost = cost_model(self.p.cost)

    def plan(self, snaps: dict[int, InstanceSnap], items: Iterable[Item], buffers: StalenessBuffers,
             until: int | None = None) -> list[tuple[int, Item]]:
        return marginal_plan(snaps, items, buffers, self.cost, self.p.mu, until)

    def intake(self, v: Views) -> int:
        st = self.state(v)
        return ts_intake(v, st, self.p.ts_groups) if coordinating(v, st, self.p.period_s) else 0

    def admit(self, v: Views) -> list[Submit]:
        st = self.state(v)
        st.planner = self.plan
        if not coordinating(v, st, self.p.period_s):
            return []
        fold(v, st)
        snaps = snapshots(v, st, self.p.block_size, self.cost.p.kv_budget_tokens or float("inf"))
        return submits(self.plan(snaps, ts_items(v, st), st.buffers), st.held)

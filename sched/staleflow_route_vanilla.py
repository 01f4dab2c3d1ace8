"""StaleFlow's vanilla routing (§6.5 ablation): "Trajectories are assigned purely by load balancing their
counts. Each trajectory in TS is routed to the instance with the fewest trajectories."

Same TS, MLQ order and staleness check as `staleflow` routing (Alg. 2 still applies: a bound is a bound), but no
cost model and no withholding: everything the staleness manager admits is routed at once. With vanilla sync
and no migration this is the strict-staleness regime the paper says matches VeRL-Async.

Invariant kept: as `staleflow` routing, every routed trajectory's group holds an entry with V + eta >= V_buf.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from config import F
from sched.base import Dispatch, Submit, Views, register
from sched.staleflow_cost import InstanceSnap
from sched.staleflow_route import submits
from sched.staleflow_state import Item, Member, coordinating, fold, snapshots
from sched.staleflow_store import commit, routable, ts_intake, ts_items
from sched.staleness import StalenessBuffers


def fewest_plan(snaps: dict[int, InstanceSnap], items: Iterable[Item], buffers: StalenessBuffers,
                until: int | None = None) -> list[tuple[int, Item]]:
    load = {e: s.running + s.waiting for e, s in snaps.items()}
    out: list[tuple[int, Item]] = []
    for it in items:
        cands = [s for s in snaps.values() if routable(buffers, it, s)]
        if not cands:
            break                                   # MLQ head-of-line, as in Alg. 3
        chosen = min(cands, key=lambda s: (load[s.engine], s.engine))
        commit(buffers, it, chosen.version)
        load[chosen.engine] += 1
        out.append((chosen.engine, it))
        if until is not None and chosen.engine == until:
            break
    return out


@register
class VanillaRouting(Member, Dispatch):
    name = "staleflow_vanilla"

    @dataclass
    class Params:
        eta: int = F(3, ge=0, help="staleness bound: trainer version - V_traj at consumption (§4.2)")
        period_s: float = F(1.0, ge=0, help="coordination period: Algorithm 1 runs at most this often")
        ts_groups: int = F(0, ge=0, help="trajectory-store capacity in unreserved groups (0: (eta + 1) x batch)")
        block_size: int = F(16, ge=1, help="tokens per KV block in the engines' reports")

    def plan(self, snaps: dict[int, InstanceSnap], items: Iterable[Item], buffers: StalenessBuffers,
             until: int | None = None) -> list[tuple[int, Item]]:
        return fewest_plan(snaps, items, buffers, until)

    def intake(self, v: Views) -> int:
        st = self.state(v)
        return ts_intake(v, st, self.p.ts_groups) if coordinating(v, st, self.p.period_s) else 0

    def admit(self, v: Views) -> list[Submit]:
        st = self.state(v)
        st.planner = self.plan
        if not coordinating(v, st, self.p.period_s):
            return []
        fold(v, st)
        snaps = snapshots(v, st, self.p.block_size, float("inf"))
        return submits(self.plan(snaps, ts_items(v, st), st.buffers), st.held)

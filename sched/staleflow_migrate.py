"""StaleFlow migration: Algorithm 5 (§5.3), phi_wait = 3, phi_throughput = 5 (§6.1).

On a coordination pass:
  Case 1 (long wait queue, KV full): an instance with more than phi_wait trajectories in its engine's wait queue
    has the excess interrupted. Which ones the paper leaves open [gap]: we take the latest requests (highest ids,
    i.e. mostly the most recently routed: the back of the engine's FIFO queue, the ones that would wait longest).
  Case 2 (imbalance): with throughputs T_i from the cost model (Eq. 2), if max T / min T > phi_throughput, every
    trajectory on the highest-throughput instance is interrupted "and returned to the TS for redistribution by
    the routing strategy". An idle instance (T = 0) or one mid-Pull would make the ratio infinite and fire every
    pass [gap]: both are left out of the min and the max (seeds_staleflow.md §1.11, suggested choice); an
    idle instance is routing's to fill, not migration's.
Interrupted trajectories go back to the TS (pending, with their V_traj and tokens) and routing re-places them by
MLQ priority; they may not resume on an instance older than their newest token (the controller checks it).

Invariant kept: migration never changes a V_traj or a buffer entry (§4.3: transparent to the protocol).
"""
from __future__ import annotations

from dataclasses import dataclass

from config import F
from sched.base import Abort, Interrupt, Migrate, Rebalance, Views, register
from sched.staleflow_state import Member, coordinating, cost_model, snapshots


@register
class StaleFlowMigration(Member, Rebalance):
    name = "staleflow"

    @dataclass
    class Params:
        eta: int = F(3, ge=0, help="staleness bound (the same eta as the other StaleFlow tables)")
        phi_wait: int = F(3, ge=0, help="Case 1: wait-queue length above which the excess migrates")
        phi_throughput: float = F(5.0, ge=1, help="Case 2: max/min instance throughput ratio that drains the max")
        period_s: float = F(1.0, ge=0, help="coordination period (the same as the routing's)")
        block_size: int = F(16, ge=1, help="tokens per KV block in the engines' reports")
        cost: dict[str, float] = F({}, help="cost model coefficients k1..k5, kv_budget_tokens (default Table 4)")

    def __init__(self, params: "StaleFlowMigration.Params | None" = None):
        super().__init__(params)
        self.cost = cost_model(self.p.cost)
        self.migrated = 0

    def plan(self, v: Views) -> list[Abort | Interrupt | Migrate]:
        st = self.state(v)
        if not coordinating(v, st, self.p.period_s):
            return []
        snaps = snapshots(v, st, self.p.block_size, self.cost.p.kv_budget_tokens or float("inf"))
        out: dict[int, list[int]] = {}
        for e, s in snaps.items():                                    # Case 1
            excess = s.waiting - self.p.phi_wait
            if excess > 0 and s.held:
                out[e] = list(s.held[-excess:])
        thr = {e: self.cost.throughput(s) for e, s in snaps.items() if s.running > 0 and not s.loading}
        if len(thr) >= 2:                                              # Case 2
            hi, lo = max(thr, key=lambda e: (thr[e], -e)), min(thr, key=lambda e: (thr[e], e))
            if thr[hi] > self.p.phi_throughput * thr[lo]:
                picked = set(out.get(hi, []))
                out[hi] = out.get(hi, []) + [i for i in snaps[hi].held if i not in picked]
        self.migrated += sum(len(ids) for ids in out.values())
        return [Interrupt(e, ids) for e, ids in sorted(out.items()) if ids]

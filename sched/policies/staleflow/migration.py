"""StaleFlow's migration strategy: Algorithm 5 (§5.3, App. D), phi_wait = 3, phi_throughput = 5 (§6.1).

A part of the StaleFlow design (algorithm1.py): `select` is the MigrationStrategy of Algorithm 1's line 11, on the
snapshot the sync step left; line 12 interrupts what it selects, and routing (line 16) re-places the trajectories
by MLQ priority once their interrupts land. They may not resume on an instance older than their newest token (the
controller checks it).

Invariant kept: migration never changes a V_traj or a buffer entry (§4.3: transparent to the protocol).
"""
from __future__ import annotations

from dataclasses import dataclass

from config import F
from sched.base import Preset, Rebalance, register
from sched.policies.staleflow.cost import ThroughputModel
from sched.policies.staleflow.state import Snaps, design_state


@register
class StaleFlowMigration(Rebalance):
    """Algorithm 5 on a snapshot:
      Case 1 (long wait queue, KV full): an instance with more than phi_wait trajectories in its engine's wait
        queue has the excess interrupted. Which ones the paper leaves open: we take the latest requests (highest
        ids, mostly the most recently routed: the back of the engine's FIFO queue, the ones that would wait longest).
        A multi-turn trajectory waiting on a tool call is in neither the queue nor the batch: neither case moves it
        (its call would start over where it lands, and it frees no decode seat).
      Case 2 (imbalance): with throughputs T_i from the cost model (Eq. 2), if max T / min T > phi_throughput, every
        trajectory on the highest-throughput instance is interrupted "and returned to the TS for redistribution by
        the routing strategy". The paper does not say what an idle instance (T = 0) or one mid-Pull does to the
        ratio; both would make it infinite and fire every pass, so both are left out of the min and the max (an
        idle instance is routing's to fill, not migration's)."""
    name = "staleflow"
    paper = "StaleFlow §5.3, Algorithm 5 (migration)"

    @dataclass
    class Params:
        phi_wait: int = F(3, ge=0, help="Case 1: wait-queue length above which the excess migrates")
        phi_throughput: float = F(5.0, ge=1, help="Case 2: max/min instance throughput ratio that drains the max")

    def bind(self, preset: Preset) -> None:
        design_state(preset, f"the {self.name!r} rebalance")       # a part of the design its dispatch is

    def select(self, S: Snaps, model: ThroughputModel) -> list[tuple[int, list[int]]]:
        """(instance, trajectories to interrupt) pairs, by instance (Algorithm 5)."""
        out: dict[int, list[int]] = {}
        for e, s in S.items():                                        # Case 1
            excess = s.waiting - self.p.phi_wait
            movable = s.requests[s.on_tool:]
            if excess > 0 and movable:
                out[e] = list(movable[-excess:])
        thr = {e: model.throughput(s) for e, s in S.items() if s.running > 0 and not s.loading}
        if len(thr) >= 2:                                              # Case 2
            hi, lo = max(thr, key=lambda e: (thr[e], -e)), min(thr, key=lambda e: (thr[e], e))
            if thr[hi] > self.p.phi_throughput * thr[lo]:
                picked = set(out.get(hi, []))
                out[hi] = out.get(hi, []) + [i for i in S[hi].requests[S[hi].on_tool:] if i not in picked]
        return [(e, ids) for e, ids in sorted(out.items()) if ids]

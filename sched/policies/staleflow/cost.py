"""StaleFlow's cost model (§5.3, App. B, Eq. 2-4, Table 4): an instance's decode throughput from its snapshot.

    T_i(S)      = n / (k1 * kv + max(k2, k3 * n) + k4)                      Eq. 2 (= Eq. 13), n = running
    gamma_i     = 1[kv + k5 * l <= M  and  waiting == 0]                      Eq. 3: routed trajectory would run
    dT_i        = T_i(S') - T_i(S),  S' = S + (one running, k5 * l KV) if gamma_i else unchanged (gain 0)
    dT_ideal(l) = 1 / (k1 * k5 * l + max(k2, k3) + k4)                        Eq. 4: alone on an idle instance

l = what the instance must hold for the trajectory: prompt + tokens generated so far (a partial one is
re-prefilled). kv counts tokens, so k5 = 1: the paper calls kv a "total size (e.g., in bytes)", but with Table
4's k1 only a token count gives plausible latencies (1M cached tokens: 72.8 ms of attention per step; bytes would
give hundreds of seconds);
M = the instance's KV budget in tokens (from its snapshot, or `kv_budget_tokens`).
Defaults are Table 4 (Qwen3-30B-A3B on H20); they shape decisions only, the simulator has its own cost model
(sim/cost.py). Named ThroughputModel here, so the two are never confused.

Invariant kept: pure arithmetic on snapshots; a routed trajectory that would have to queue gains nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from config import F


@dataclass(frozen=True)
class InstanceSnap:
    """One instance in a coordinator snapshot (Fig. 11), as far as the cost model needs it."""
    engine: int
    version: int             # inst_version (-1: no weights yet)
    running: int             # |run_trajs|
    waiting: int = 0         # |wait_trajs| (queued or preempted inside the engine)
    kv: float = 0.0          # KV tokens resident
    budget: float = math.inf  # M: the KV budget in tokens
    loading: bool = False    # a Pull (LoadWeights) is in flight
    requests: tuple[int, ...] = ()  # request ids on the instance (run + wait), for interrupts
    on_tool: int = 0         # of which the first on_tool wait on a tool call (multi-turn: not decoding, KV held)


@dataclass
class CostParams:
    """Eq. 2's coefficients (Table 4) and the KV budget assumed for an instance that has not reported one."""
    k1: float = F(7.28e-8, ge=0, help="s per resident KV token per decode step (Table 4)")
    k2: float = F(1.72e-3, ge=0, help="s per step, weight-read bound matmuls (Table 4)")
    k3: float = F(1.25e-4, ge=0, help="s per running sequence per step, compute-bound matmuls (Table 4)")
    k4: float = F(1.07e-2, ge=0, help="s fixed per decode step (Table 4)")
    k5: float = F(1.0, gt=0, help="KV footprint of one token, in kv units (tokens: 1)")
    kv_budget_tokens: float = F(0.0, ge=0, help="M when the instance has not reported its KV size (0: no limit)")


class ThroughputModel:
    def __init__(self, p: CostParams | None = None):
        self.p = p or CostParams()
        if self.p.k2 + self.p.k4 <= 0:
            raise ValueError("staleflow cost model: a decode step must take time (k2 + k4 > 0)")

    def latency(self, n: int, kv: float) -> float:
        p = self.p
        return p.k1 * kv + max(p.k2, p.k3 * n) + p.k4

    def throughput(self, s: InstanceSnap) -> float:
        return s.running / self.latency(s.running, s.kv) if s.running > 0 else 0.0

    def fits(self, s: InstanceSnap, length: int) -> bool:
        """gamma_i of Eq. 3."""
        return s.waiting == 0 and s.kv + self.p.k5 * length <= s.budget

    def after_route(self, s: InstanceSnap, length: int) -> InstanceSnap:
        """S' of Eq. 3: the trajectory runs (gamma = 1) or joins the wait queue."""
        if self.fits(s, length):
            return replace(s, running=s.running + 1, kv=s.kv + self.p.k5 * length)
        return replace(s, waiting=s.waiting + 1)

    def marginal_gain(self, s: InstanceSnap, length: int) -> float:
        """throughput(after_route(s, length)) - throughput(s), the same arithmetic without building S'."""
        p = self.p
        kv = s.kv + p.k5 * length
        if s.waiting != 0 or kv > s.budget:
            return 0.0
        n = s.running
        after = (n + 1) / (p.k1 * kv + max(p.k2, p.k3 * (n + 1)) + p.k4)
        return after - (n / (p.k1 * s.kv + max(p.k2, p.k3 * n) + p.k4) if n > 0 else 0.0)

    def best_gain(self, snaps: list[InstanceSnap], length: int) -> tuple[float, InstanceSnap]:
        """The instance of `snaps` with the largest `marginal_gain` (the lowest engine id among equals), and its
        gain: the same arithmetic, inlined (routing asks this for every trajectory of every pass)."""
        p = self.p
        k1, k2, k3, k4, dkv = p.k1, p.k2, p.k3, p.k4, p.k5 * length
        best, top = snaps[0], -math.inf
        for s in snaps:
            kv, n = s.kv + dkv, s.running
            if s.waiting != 0 or kv > s.budget:
                g = 0.0
            else:                               # max(k2, k3 x n) as a comparison: this loop is hot
                c = k3 * (n + 1)
                g = (n + 1) / (k1 * kv + (c if c > k2 else k2) + k4)
                if n > 0:
                    c = k3 * n
                    g -= n / (k1 * s.kv + (c if c > k2 else k2) + k4)
            if g > top or (g == top and s.engine < best.engine):
                best, top = s, g
        return top, best

    def ideal_gain(self, length: int) -> float:
        p = self.p
        return 1.0 / (p.k1 * p.k5 * length + max(p.k2, p.k3) + p.k4)

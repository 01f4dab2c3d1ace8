"""Dynamic repack of long-tail trajectories: Laminar §5 (Algorithm 1, Fig. 8-9), the rebalance half of Laminar.

When a rollout's batch is down to its long tail its decode batch is tiny and, decoding being memory-bound, nearly
as slow per step as a full one (§2.4). The rollout manager therefore, periodically (`period_s`, "e.g., 5 seconds")
and right after each trainer update (`on_update`, §5.1), groups engines by weight version and, per group, runs the
Best-Fit consolidation of Algorithm 1 over the engines in their KV ramp-down phase (§5.2's idleness metric):

    S = {r : C_used(r) < min(C_max, C_prev(r)) and N_reqs(r) < B}   sorted by C_used ascending
    for s in S (not emptied, and -- the guard -- not already a destination in this plan):
        D = {d in S, d != s, not emptied : C_load(d) + C_used(s) <= C_max and N_load(d) + N_reqs(s) <= B}
        d* = argmax_D C_load(d) (ties: lowest engine id)        -> move every unfinished trajectory of s to d*

C_used is the KV fraction in use (`tokens_decoded` counters), C_prev its value at the previous check, N_reqs the
engine's unfinished trajectories, C_max the bin capacity (">99%"), B the roofline batch size (no value in the
paper; 64 after §2.4's "batch <8 has nearly the same latency as 64"). `idle_rule = "drained"` replaces the strict
KV decrease (which needs a completion between two checks) by "nothing queued and C_used < C_max". A move is a
`Migrate`: the controller interrupts the trajectories on s and resubmits them to d*, which re-prefills them (the
paper leaves KV transfer vs recompute open; recompute is what our engine does). The emptied source then pulls the
latest weights and takes a new batch (laminar/weight_sync.py, laminar/dispatch.py); neither reloads nor refills a
destination while trajectories are on their way to it (`Views.migrating_to`), so nothing is stranded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import Rebalance, register
from sched.decisions import Migrate
from sched.views import RequestState, Views

S = RequestState


@dataclass(frozen=True)
class EngineCheck:
    """What the rollout manager sees of one engine at a check (§5.1)."""
    engine: int
    version: int
    c_used: float      # KV in use / capacity
    c_prev: float      # c_used at the previous check
    n_reqs: int        # unfinished trajectories on it
    waiting: int = 0   # queued at the engine, not yet decoding


def candidates(snaps: list[EngineCheck], c_max: float, b: int, rule: str = "alg1") -> list[EngineCheck]:
    """Engines in the ramp-down phase (Algorithm 1 line 1), smallest KV first (line 2; ties by engine id)."""
    if rule == "alg1":
        ok = [s for s in snaps if s.c_used < min(c_max, s.c_prev) and s.n_reqs < b]
    else:
        ok = [s for s in snaps if s.waiting == 0 and s.c_used < c_max and s.n_reqs < b]
    return sorted((s for s in ok if s.n_reqs > 0), key=lambda s: (s.c_used, s.engine))


def best_fit(snaps: list[EngineCheck], c_max: float, b: int, rule: str = "alg1",
             guard: bool = True) -> list[tuple[int, int]]:
    """Algorithm 1 over one version group: (source, destination) pairs. `guard=False` is the algorithm as
    printed (a destination may later be chosen as a source: a chained move)."""
    if len({s.version for s in snaps}) > 1:
        raise ValueError("best_fit: one weight-version group at a time")
    S = candidates(snaps, c_max, b, rule)
    load_c = {s.engine: s.c_used for s in S}
    load_n = {s.engine: s.n_reqs for s in S}
    plan: list[tuple[int, int]] = []
    emptied: set[int] = set()
    dests: set[int] = set()
    for s in S:
        if s.engine in emptied or (guard and s.engine in dests):
            continue
        fits = [d for d in S if d.engine != s.engine and d.engine not in emptied
                and load_c[d.engine] + s.c_used <= c_max and load_n[d.engine] + s.n_reqs <= b]
        if fits:
            d = max(fits, key=lambda d: (load_c[d.engine], -d.engine))
            plan.append((s.engine, d.engine))
            emptied.add(s.engine)
            dests.add(d.engine)
            load_c[d.engine] += s.c_used
            load_n[d.engine] += s.n_reqs
    return plan


@register
class Repack(Rebalance):
    """Algorithm 1 every `period_s` and after each update, per weight version.

    Invariants kept: a trajectory only ever moves between engines holding the SAME weight version (so it stays
    single-version), never onto an engine that is loading or empty, never onto an engine that is itself a source
    (the chained-move guard: the printed algorithm could empty a destination after assigning sources to it), and
    never while an earlier move touching either engine is still in flight, never from or onto a failed engine.

    The rollout manager also isolates engine faults (§3.3, `engine_failures`): engines stream each trajectory's
    tokens so far to the controller's partial-response pool (sched/partials.py); a failed engine's trajectories
    resume on healthy engines of their version (laminar/dispatch.py) and the engine rejoins once rebuilt
    (runtime/rollout_worker.py)."""
    name = "repack"
    paper = "Laminar §5, Algorithm 1 (Best-Fit repack); §3.3 (fault isolation)"
    skips_failed_engines = True

    @dataclass
    class Params:
        period_s: float = F(5.0, gt=0, help="seconds between checks (§5.1: 'e.g., 5 seconds')")
        on_update: bool = F(True, help="also check right after each trainer update (§5.1)")
        c_max: float = F(0.99, gt=0, le=1, help="C_max: KV fraction a destination may fill up to")
        batch: int = F(64, ge=1, help="B: roofline batch size, most trajectories on a destination")
        idle_rule: str = F("alg1", choices=("alg1", "drained"),
                           help="ramp-down test: Algorithm 1's strict KV decrease, or queue empty and below C_max")
        guard: bool = F(True, help="skip a source already chosen as a destination (no chained moves)")
        engine_failures: int = F(3, ge=0, help="failures of one engine the rollout manager recovers from (§3.3); "
                                 "past them it is retired; 0: an engine failure ends the run")

    def __init__(self, params: "Repack.Params | None" = None):
        super().__init__(params)
        self.last_check = -math.inf
        self.last_version = 0
        self.kv_prev: dict[int, float] = {}
        self.moves = 0

    def failures_isolated(self) -> int:
        return self.p.engine_failures

    def due(self, v: Views) -> bool:
        if v.now - self.last_check >= self.p.period_s:
            return True
        return self.p.on_update and v.trainer.version > self.last_version

    def plan(self, v: Views) -> list[Migrate]:
        if not self.due(v):
            return []
        self.last_check, self.last_version = v.now, v.trainer.version
        table = v.requests                      # its per-engine index: requests on each engine, by state
        busy = {r.engine for r in v.requests.in_state(S.INTERRUPTING) if r.engine >= 0}
        snaps: dict[int, list[EngineCheck]] = {}
        for e in v.engines:
            cap = e.kv_used + e.kv_free
            c = e.kv_used / cap if cap > 0 else 0.0
            prev, self.kv_prev[e.engine] = self.kv_prev.get(e.engine, c), c
            if cap <= 0 or e.loading or e.failed or e.version < 0 or e.engine in busy or v.migrating_to(e.engine):
                continue
            n = table.count_on(e.engine, S.RUNNING)
            snaps.setdefault(e.version, []).append(EngineCheck(e.engine, e.version, c, prev, n, e.waiting))
        out: list[Migrate] = []
        for version in sorted(snaps):
            for src, dst in best_fit(snaps[version], self.p.c_max, self.p.batch, self.p.idle_rule, self.p.guard):
                assert v.engines[src].version == v.engines[dst].version == version
                ids = [r.req_id for r in table.on_engine(src) if r.state == S.RUNNING]   # in id order
                if ids:
                    out.append(Migrate(src, dst, ids))
                    self.moves += 1
        return out

    def stats(self) -> dict[str, float]:
        return {"moves": self.moves}

    def state_dict(self) -> dict[str, Any]:
        return {"moves": self.moves}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.moves = int(state.get("moves", 0))

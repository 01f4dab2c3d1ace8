"""StaleFlow's rollout coordinator (§5.2-5.3): the preset's design object, and Algorithm 1 as one function.

A StaleFlow preset names four mechanisms (configs/sched/staleflow.toml); three of them decide together, on one
snapshot, as the paper's coordinator does. `StaleFlow` is the preset's dispatch (its table holds the design's
parameters, state.py) and a Design (sched/base.py): at bind it takes the preset's StaleFlow weight sync (sync.py,
Algorithm 4 or vanilla) and migration (migration.py, Algorithm 5) as its parts, and each decision round it returns
the decisions of every kind it fills. On a coordination pass that is `algorithm1` below, numbered as the paper's lines:
sync, then migration, then routing (routing.py, Algorithms 2-3), each on the snapshot the commands before it left.
The hand-off (handoff.py, Consume §4.2) reads the same state; the update is the ordinary step_publish.

Invariant kept: nothing is admitted that the staleness manager did not reserve for (every routed trajectory's group
holds an entry with V + eta >= V_buf), and within a pass routing never places a trajectory on an instance the sync
left mid-Pull nor counts the trajectories the sync or the migration took off an instance.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from config import F
from sched.base import Design, Dispatch, Preset, register
from sched.decisions import Interrupt, Joint, LoadWeights, RoundPlan, Submit
from sched.policies.staleflow.buffers import StalenessBuffers
from sched.policies.staleflow.cost import InstanceSnap
from sched.policies.staleflow.migration import StaleFlowMigration
from sched.policies.staleflow.routing import Route, fewest_routes, marginal_routes
from sched.policies.staleflow.state import Snaps, StaleFlowParams, StaleFlowState
from sched.policies.staleflow.store import Item, TSQueue, ts_intake
from sched.policies.staleflow.sync import StaleFlowSync
from sched.views import Views


@register
class StaleFlow(Design, Dispatch):
    """The routing dispatch (Algorithm 3 with the cost model's marginal gain, mu = 0.3), and the coordinator that runs
    Algorithm 1 with it and the preset's StaleFlow sync and migration once per coordination period. Intake: the TS
    keeps `ts_groups` unreserved groups waiting (store.py)."""
    name = "staleflow"
    paper = "StaleFlow §5.2-5.3, Algorithm 1 over Algorithms 2-3 (MLQ, waterfall, marginal gain)"
    reads_progress = True   # the snapshot's estimate of an engine whose report predates a command (state.py)

    @dataclass
    class Params(StaleFlowParams):
        mu: float = F(0.3, ge=0, help="route only if the marginal gain is at least mu x the ideal gain (§6.1)")

    def __init__(self, params: Any = None):
        super().__init__(params)
        self.state = StaleFlowState(self.p)
        self.sync: StaleFlowSync | None = None
        self.migration: StaleFlowMigration | None = None

    def bind(self, preset: Preset) -> None:
        """Take the preset's StaleFlow weight sync and migration as parts; a mechanism of another name fills its kind
        as usual (the vanilla preset's rebalance is `none`)."""
        self.sync = preset.weight_sync if isinstance(preset.weight_sync, StaleFlowSync) else None
        self.migration = preset.rebalance if isinstance(preset.rebalance, StaleFlowMigration) else None

    def counters_period_s(self) -> float:
        """The snapshot is taken every coordination pass (Fig. 11): the engines report at that period."""
        return self.p.period_s

    def staleness_bound(self) -> int | None:
        return self.p.eta

    def kv_budget(self) -> float:
        """M for an instance that has not reported its KV size."""
        return self.p.cost.kv_budget_tokens or math.inf

    def route(self, snaps: Snaps, items: Iterable[Item], buffers: StalenessBuffers,
              until: int | None = None) -> list[tuple[int, Item]]:
        return marginal_routes(snaps, items, buffers, self.state.model, self.p.mu, until)

    def intake(self, v: Views) -> int | RoundPlan:
        st = self.state
        n = ts_intake(v, st.buffers(v), self.p.ts_groups) if st.coordinating(v) else 0
        G = st.aborts.group_size(v.group_size)
        return RoundPlan(fresh=n, group_size=G) if n and G > v.group_size else n

    def decide(self, v: Views) -> Joint:
        """Every round, the weight sync's unpaced loads (sync.py); on a coordination pass, Algorithm 1 on a new
        snapshot, the staleness buffers brought up to date first (Occupy and removals, §4.3)."""
        st = self.state
        passing = st.coordinating(v)
        loads = self.sync.unpaced(v, st, passing) if self.sync else []
        routes, pulls, moves = [], [], []
        if passing:
            st.sync_buffers(v)
            routes, pulls, moves = algorithm1(v, st, st.snapshots(v, self.kv_budget()), self.route, self.sync,
                                              self.migration)
        return Joint(submit=routes, weight_sync=loads + pulls if self.sync else None,
                     rebalance=moves if self.migration else None)

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
class VanillaRouting(StaleFlow):
    """The §6.5 ablation: "Trajectories are assigned purely by load balancing their counts. Each trajectory in TS
    is routed to the instance with the fewest trajectories." Same TS, MLQ order and staleness check (a bound is a
    bound), but no cost model and no withholding: everything the staleness manager admits is routed at once. With
    vanilla sync and no migration this is the strict-staleness regime the paper says matches VeRL-Async."""
    name = "staleflow_vanilla"
    paper = "StaleFlow §6.5 ablation: vanilla routing (fewest trajectories)"
    Params = StaleFlowParams

    def kv_budget(self) -> float:
        return math.inf

    def route(self, snaps: Snaps, items: Iterable[Item], buffers: StalenessBuffers,
              until: int | None = None) -> list[tuple[int, Item]]:
        return fewest_routes(snaps, items, buffers, until)


def algorithm1(v: Views, st: StaleFlowState, S: Snaps, route: Route, sync: StaleFlowSync | None,
               migration: StaleFlowMigration | None) -> tuple[list[Submit], list[Interrupt | LoadWeights],
                                                               list[Interrupt]]:
    """Algorithm 1, the rollout coordination procedure, on S, the snapshot of every instance (validated by Eq. 1,
    state.py; changed here as the paper's S is). Returns the pass's Routes (one Submit per instance; routing has
    Reserved their buffer entries), its sync's Interrupts and Pulls, and its migration's Interrupts. Lines 9 and 14
    take effect later: an interrupted trajectory is back in the TS once its Interrupt lands (§5.2, "a Route command
    must wait until all interrupted trajectories have been returned to the TS"), and a later pass routes it."""
    buffers = st.buffers(v)
    ts = TSQueue(v, buffers, st.aborts.dropping)            # 1  ts_trajs <- get_ts_trajs()   (in MLQ order)
    ps = v.trainer.published                                # 2  ps_version <- get_ps_version()
    pulls: list[Interrupt | LoadWeights] = []
    selected = sync.select(S, ts, buffers, ps, route) if sync else []
    for inst in selected:                                   # 4  foreach inst in SynchronizationStrategy(S, ts, ps)
        trajs = list(S[inst].requests)                      # 5    trajs <- S[inst].run_trajs U S[inst].wait_trajs
        if trajs:                                           # 6    IssueCommand(Interrupt(inst, trajs), Pull(inst))
            pulls.append(Interrupt(inst, trajs))
        pulls.append(LoadWeights(inst, ps))
        S[inst] = discard(S[inst], trajs)                   # 7    S[inst].discard(trajs)
        S[inst] = replace(S[inst], version=ps, loading=True)  # 8   S[inst].inst_version <- ps (mid-Pull)
                                                            # 9    ts_trajs <- ts_trajs U trajs (once they land)
    moves: list[Interrupt] = []
    migrating = migration.select(S, st.model) if migration else []
    for inst, trajs in migrating:                           # 11 foreach (inst, trajs) in MigrationStrategy(S)
        moves.append(Interrupt(inst, trajs))                # 12   IssueCommand(Interrupt(inst, trajs))
        S[inst] = discard(S[inst], trajs)                   # 13   S[inst].discard(trajs)
                                                            # 14   ts_trajs <- ts_trajs U trajs (once they land)
    routed: dict[int, list[int]] = {}
    for inst, it in route(S, ts, buffers):                  # 16 foreach (inst, trajs) in RoutingStrategy(S, ts)
        routed.setdefault(inst, []).append(it.req.req_id)   # 17   IssueCommand(Route(inst, trajs))
        st.routed.add(it.req.req_id)
    return [Submit(e, ids) for e, ids in sorted(routed.items())], pulls, moves


def discard(s: InstanceSnap, trajs: list[int]) -> InstanceSnap:
    """S[inst].discard(trajs): the instance's snapshot once they left it, waiting ones first (Alg. 5's Case 1 takes
    the excess of the wait queue), the KV of those that were running in proportion."""
    if not trajs:
        return s
    gone = set(trajs)
    n = sum(1 for i in s.requests[s.on_tool:] if i in gone)     # one waiting on a tool neither runs nor waits
    from_wait = min(s.waiting, n)
    running = max(0, s.running - (n - from_wait))
    kv = s.kv * running / s.running if s.running else 0.0
    return replace(s, running=running, waiting=s.waiting - from_wait, kv=kv,
                   requests=tuple(i for i in s.requests if i not in gone),
                   on_tool=sum(1 for i in s.requests[:s.on_tool] if i not in gone))

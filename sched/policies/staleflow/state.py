"""What StaleFlow's mechanisms share (§3, §5.1-5.2): one parameter set and one state, held by the design object (the
routing dispatch, algorithm1.py); the hand-off, the weight sync and the migration check for it at bind time.

    StaleFlowParams  eta, the coordination period, the trajectory-store capacity, the KV block size and the cost
                     model's coefficients: set once, in the preset's [dispatch] table
    StaleFlowState   the staleness manager's buffers (buffers.py) and Aborts (aborts.py), the requests routed and
                     maybe still on an engine, the coordination-pass memo, and the snapshot of Eq. 1 (`snapshots`)

How the paper's pieces map onto ours:
- Trajectory store = the controller's pending requests, read in MLQ order (store.py).
- Parameter store = each rollout rank's relay (runtime/rollout_worker.py): the CPU copy of the latest published
  weights, pushed by the trainer's publication; a LoadWeights (the paper's Pull) copies it into the engine.
- Snapshot (Fig. 11) = per engine: version, requests on it (the controller's bookkeeping, updated when a command
  is ISSUED: submit -> running, interrupt -> interrupting), and the engine's last reported counters (running,
  waiting, KV blocks from `tokens_decoded`).
- Eq. 1 (snapshot validation): the controller's request states play the speculative state P (they change at
  issuance, as Table 1's do). An engine's reported counters are accepted only if they agree with P: reported
  running + waiting == requests the controller has on it, and no Pull in flight. Otherwise the report predates a
  command; instead of discarding the whole snapshot and idling until the next one (the paper's choice, which
  assumes a fast periodic pull), the coordinator uses P's estimate for that engine: KV = sum over its requests of
  prompt + tokens so far. The tokens so far come with the counters (`tokens_decoded` data `progress`: the routing
  declares `reads_progress`, so the runtime's rollout workers and the simulator's engines report them). An empty
  instance mid-Pull needs no report (P is exact: nothing is on it), so it counts in neither the accepted nor the
  estimated snapshots (`Dispatch.stats`: `snapshots_empty_pull`).
- Coordination period: Algorithm 1 runs at most once per `period_s` (the paper's snapshot period, unreported), on
  the first event after it elapsed, or at once whenever nothing is in flight (else no event would ever come).
- Staleness protocol from the views (`sync_buffers`): a reserved group is completed (Occupy, after the reward of
  every member, §4.3) once the controller reports it materialised, and removed if it became void. The staleness
  manager's own Aborts (redundancy and filtering, aborts.py) drop a group's entry there first; the hand-off sends
  the Aborts.

Invariant kept: the buffers change only through the staleness protocol (Reserve at routing, Occupy, Consume,
the Aborts' removals), so every entry keeps V_traj + eta >= V_buf (StalenessBuffers.check asserts it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from config import F
from sched.policies.staleflow.aborts import StalenessAborts, spare
from sched.policies.staleflow.buffers import StalenessBuffers
from sched.policies.staleflow.cost import CostParams, InstanceSnap, ThroughputModel
from sched.views import Request, RequestState, Views

if TYPE_CHECKING:
    from sched.base import Preset

Snaps = dict[int, InstanceSnap]
RUNNING = RequestState.RUNNING
_req_id = attrgetter("req_id")


@dataclass
class StaleFlowParams:
    """The parameters every StaleFlow mechanism of a preset reads (the routing dispatch's table sets them)."""
    eta: int = F(3, ge=0, help="staleness bound: trainer version - V_traj at consumption (§4.2)")
    period_s: float = F(1.0, ge=0, help="coordination period: Algorithm 1 (routing, sync, migration) runs at most "
                                        "this often")
    ts_groups: int = F(0, ge=0, help="trajectory-store capacity in unreserved groups (0: (eta + 1) x batch)")
    block_size: int = F(16, ge=1, help="tokens per KV block in the engines' reports")
    cost: CostParams = F(CostParams, help="cost model coefficients k1..k5 and kv_budget_tokens (default Table 4): "
                                          "routing's marginal gain, migration's throughput ratio")
    batch_redundancy: float = F(0.0, ge=0, help="spare groups per buffer as a fraction of the batch (Fig. 8b; App. "
                                                "C: 1/16), aborted once the batch is occupied; off in the paper's runs")
    group_redundancy: float = F(0.0, ge=0, help="spare samples per group as a fraction of G (Fig. 8b), the last to "
                                                "finish aborted; off in the paper's main runs")
    filter_uniform: bool = F(False, help="filter groups whose rewards are all equal (Fig. 8c, DAPO's dynamic "
                                         "sampling): later occupied groups fill their entry")
    stuck_filter_s: float = F(0.0, ge=0, help="filter the next buffer's reserved groups once it has been Stuck this "
                                              "long (Fig. 8c: delayed trajectories); 0: never")


@dataclass(slots=True)
class _OnEngine:
    """The requests StaleFlow routed to one engine that are still on it, as of the request table's `stamp`."""
    stamp: int
    table: Any             # the request table it was read from
    reqs: list[Request]    # in id order
    keys: tuple[int, ...]  # their ids
    running: list[Request]  # the RUNNING ones, those waiting on a tool first
    ids: tuple[int, ...]   # their ids, in that order
    tools: int             # how many wait on a tool


class StaleFlowState:
    def __init__(self, p: StaleFlowParams):
        self.p = p
        self.model = ThroughputModel(p.cost)
        self.aborts = StalenessAborts(p.batch_redundancy, p.group_redundancy, p.filter_uniform, p.stuck_filter_s)
        self._buffers: StalenessBuffers | None = None
        self._restore: dict[str, Any] | None = None  # buffers from a checkpoint, installed at the first use
        self.routed: set[int] = set()        # request ids routed (or migrated) that may still be on an engine
        self.last_pass = -math.inf
        self.pass_seq = -1
        self.passing = False
        self.synced: tuple[int, int] | None = None  # (v.materialized, v.dropped) at the last buffer sync
        self.snaps_accepted = 0                  # engine reports Eq. 1 accepted in a snapshot
        self.snaps_estimated = 0                 # ... and those it replaced by P's estimate (they predated a command)
        self.snaps_empty_pull = 0                # empty instances mid-Pull: P is exact (nothing on it), no report read
        self._engines: dict[int, _OnEngine] = {}   # engine -> what the snapshot last read of its requests

    def buffers(self, v: Views) -> StalenessBuffers:
        """The staleness buffers, made at their first use: `prompts_per_step` entries each, starting at the
        trainer's version (or restored from the checkpoint)."""
        if self._buffers is None:
            if self._restore is not None:
                self._buffers, self._restore = StalenessBuffers.from_state_dict(self._restore), None
            else:
                B = v.prompts_per_step
                self._buffers = StalenessBuffers(self.p.eta, B, v.trainer.version, spare(B, self.p.batch_redundancy))
        return self._buffers

    def coordinating(self, v: Views) -> bool:
        """Whether this decision round is a coordination pass (memoised per event: every mechanism sees the same)."""
        if self.pass_seq != v.seq:
            self.pass_seq = v.seq
            idle = not any(e.assigned for e in v.engines)
            self.passing = idle or v.now - self.last_pass >= self.p.period_s
            if self.passing:
                self.last_pass = v.now
        return self.passing

    def sync_buffers(self, v: Views) -> None:
        """Occupy groups that materialised, remove groups that became void (§4.2-4.3); the staleness manager's
        filter and surplus (aborts.py) drop theirs."""
        self.aborts.race(v)        # first: which samples of a redundant group are kept (the filter reads them)
        if self.synced == (v.materialized, v.dropped):
            return                 # no group materialised or lost a sample since the last sync
        self.synced = (v.materialized, v.dropped)
        sb = self.buffers(v)
        for key in [k for k, (b, i) in sb.loc.items() if not sb.buf[b][i].occupied]:  # type: ignore[union-attr]
            if key not in sb.loc:
                continue           # dropped as surplus by an earlier completion in this loop
            g = v.groups.get(key)
            if g is None or g.void:
                sb.remove(key)
            elif g.materialized:
                sb.complete(key)
                self.aborts.occupied(sb, g, v)
        self.aborts.take_surplus(sb)

    def _engine(self, v: Views, engine: int) -> _OnEngine:
        """What the snapshot reads of one engine's requests, kept until the request table's stamp of the engine
        moves (a request entered or left it, changed state or tool wait): a routed request joins an engine only by
        its admission, and `routed` loses only requests on no engine, so nothing else changes it."""
        table = v.requests
        stamp = table.engine_stamp(engine)
        c = self._engines.get(engine)
        if c is not None and c.stamp == stamp and c.table is table:
            return c
        routed = self.routed
        reqs = [r for r in table.on_engine(engine) if r.req_id in routed]
        running = [r for r in reqs if r.state is RUNNING]
        # a multi-turn request waiting on a tool (`on_tool`) is RUNNING but in neither the engine's batch nor its
        # queue (its KV held: in kv_used); its id comes first in the snapshot's `requests` (migration moves what
        # decodes or queues, not a call in flight)
        on_tool = [r for r in running if r.tool_since >= 0]
        if on_tool:
            running = on_tool + [r for r in running if r.tool_since < 0]
        c = self._engines[engine] = _OnEngine(stamp, table, reqs, tuple(map(_req_id, reqs)), running,
                                              tuple(map(_req_id, running)), len(on_tool))
        return c

    def on_engine(self, v: Views) -> dict[int, list[Request]]:
        """Per engine, the requests StaleFlow routed there that are still on it, in id order; `routed` is pruned to
        them. Reads the controller's per-engine index of requests, each engine's list kept until its stamp moves."""
        out: dict[int, list[Request]] = {}
        n = 0
        for e in v.engines:
            reqs = out[e.engine] = self._engine(v, e.engine).reqs
            n += len(reqs)
        if n != len(self.routed):
            self.routed = set().union(*(self._engines[e].keys for e in out))
        return out

    def snapshots(self, v: Views, budget: float) -> dict[int, InstanceSnap]:
        """The coordinator's snapshot of every instance, each engine's reported counters validated by Eq. 1."""
        self.on_engine(v)
        bs = self.p.block_size
        out = {}
        for e in v.engines:
            c = self._engines[e.engine]
            reqs, running, tools = c.reqs, c.running, c.tools
            # the snapshot's running and waiting are the engine's (a tool waiter is in neither), Eq. 1 checks the rest
            reported = e.running + e.waiting
            M = (e.kv_used + e.kv_free) * bs if e.kv_used + e.kv_free > 0 else budget
            if reported + tools == len(running) == e.assigned and not e.loading and (e.kv_used or not reqs):
                snap = InstanceSnap(e.engine, e.version, e.running, e.waiting, float(e.kv_used * bs), M, e.loading,
                                    c.ids, tools)
                self.snaps_accepted += 1
            else:
                if e.loading and not reqs and e.assigned == 0:
                    self.snaps_empty_pull += 1
                else:
                    self.snaps_estimated += 1
                kv = sum(r.prompt_len + r.tokens for r in running)     # tool waiters' KV included
                snap = InstanceSnap(e.engine, e.version, len(running) - tools, 0, float(kv), M, e.loading, c.ids,
                                    tools)
            out[e.engine] = snap
        return out

    def state_dict(self) -> dict[str, Any]:
        out = self.aborts.state_dict()
        if self._buffers is None:
            return out if self._restore is None else {**out, "buffers": self._restore}
        return {**out, "buffers": self._buffers.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._buffers, self._restore = None, state.get("buffers") or None
        self.aborts.load_state_dict(state)



def design_state(preset: "Preset", who: str) -> StaleFlowState:
    """The state of the preset's StaleFlow design, which its routing dispatch is (algorithm1.py)."""
    st = getattr(preset.dispatch, "state", None)
    if not isinstance(st, StaleFlowState):
        raise ValueError(f"{who} needs a StaleFlow routing dispatch (staleflow or staleflow_vanilla), which holds "
                         f"the design's parameters and staleness buffers; this preset's dispatch is "
                         f"{preset.dispatch.name!r}")
    return st

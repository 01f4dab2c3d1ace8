"""What StaleFlow's mechanisms share through `Views.shared["staleflow"]` (§3, §5.1-5.2): the staleness manager's
buffers (sched/staleness.py), the trajectory store (TS) and the coordinator's validated snapshot. One object,
created by whichever StaleFlow module runs first; each module checks that its eta matches.

How the paper's pieces map onto ours:
- Trajectory store = the controller's pending requests (read in MLQ order by sched/staleflow_store.py). An initial trajectory is a pending request never admitted
  (`v_traj == -1`); an interrupted one is pending again with its tokens in `partial` and its `v_traj` kept. The
  TS intake keeps `ts_groups` not-yet-reserved groups waiting (default (eta + 1) x batch, §5.1's capacity, counted
  in groups: the unit the paper leaves open).
- Parameter store = each rollout rank's relay (runtime/rollout_worker.py): the CPU copy of the latest published
  weights, pushed by the trainer's publication; a LoadWeights (the paper's Pull) copies it into the engine.
- Snapshot (Fig. 11) = per engine: version, requests held (controller's bookkeeping, updated when a command is
  ISSUED: submit -> running, interrupt -> interrupting), and the engine's last reported counters (running,
  waiting, KV blocks from `tokens_decoded`).
- Eq. 1 (snapshot validation): the controller's request states play the speculative state P (they change at
  issuance, as Table 1's do). An engine's reported counters are accepted only if they agree with P: reported
  running + waiting == requests the controller has on it, and no Pull in flight. Otherwise the report predates a
  command; instead of discarding the whole snapshot and idling until the next one (the paper's choice, which
  assumes a fast periodic pull), the coordinator uses P's estimate for that engine: KV = sum over its requests of
  prompt + tokens so far.
- Coordination period: Algorithm 1 runs at most once per `period_s` (the paper's snapshot period, unreported), on
  the first event after it elapsed, or at once whenever nothing is in flight (else no event would ever come).

Staleness protocol from the views (`fold`): a reserved group is completed (Occupy, after the reward of every
member, §4.3) once the controller reports it materialised, and removed if it became void.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from sched.staleflow_cost import CostModel, CostParams, InstanceSnap
from sched.staleness import StalenessBuffers
from sched.views import Request, Views

KEY = "staleflow"
HELD = ("running", "interrupting")


@dataclass(slots=True)
class Item:
    """A TS trajectory as routing sees it."""
    req: Request
    prio: float          # MLQ key: V_traj (or its group's version), initial trajectories of new groups last
    length: int          # l: prompt + tokens so far
    need: int            # lowest instance version it may run on (partial: its newest token; else 0)

    @property
    def initial(self) -> bool:
        return self.req.v_traj < 0


@dataclass
class Shared:
    buffers: StalenessBuffers
    held: set[int] = field(default_factory=set)    # request ids possibly on an engine (routed or migrated)
    last_pass: float = float("-inf")
    pass_seq: int = -1
    passing: bool = False
    planner: Callable[..., list[tuple[int, Item]]] | None = None  # the active routing strategy (Alg. 4 uses it)
    folded: tuple[int, int] | None = None  # (v.materialized, v.dropped) at the last fold: nothing new, no scan

    @property
    def eta(self) -> int:
        return self.buffers.eta


def shared(v: Views, eta: int) -> Shared:
    st = v.shared.get(KEY)
    if st is None:
        st = v.shared[KEY] = Shared(StalenessBuffers(eta, int(v.params["prompts_per_step"]), v.trainer.version))
    if st.eta != eta:
        raise ValueError(f"StaleFlow modules disagree on eta: {st.eta} and {eta} (set the same eta in every table)")
    return st


def cost_model(table: dict[str, float]) -> CostModel:
    try:
        return CostModel(CostParams(**table))
    except TypeError as e:
        raise ValueError(f"staleflow cost parameters {table}: {e}") from None


def coordinating(v: Views, st: Shared, period_s: float) -> bool:
    """Whether this decision round is a coordination pass (memoised per event: every module sees the same)."""
    if st.pass_seq != v.seq:
        st.pass_seq = v.seq
        idle = not any(e.assigned for e in v.engines)
        st.passing = idle or v.now - st.last_pass >= period_s
        if st.passing:
            st.last_pass = v.now
    return st.passing


def fold(v: Views, st: Shared) -> None:
    """Occupy groups that materialised, drop groups that became void (§4.2-4.3)."""
    if st.folded == (v.materialized, v.dropped):
        return                 # no group materialised or lost a sample since the last fold
    st.folded = (v.materialized, v.dropped)
    sb = st.buffers
    for key in [k for k, (b, i) in sb.loc.items() if not sb.buf[b][i].occupied]:  # type: ignore[union-attr]
        g = v.groups.get(key)
        if g is None or g.void:
            sb.remove(key)
        elif g.materialized:
            sb.complete(key)


def held_requests(v: Views, st: Shared) -> dict[int, list[Request]]:
    """Per engine, the requests StaleFlow routed there that are still on it (running or interrupting), in id
    order; `st.held` is pruned to them. Reads the controller's running/interrupting index: O(requests held), not
    O(every request ever routed)."""
    out: dict[int, list[Request]] = {e.engine: [] for e in v.engines}
    held = st.held
    keep = []
    for r in v.requests.in_state(*HELD):
        if r.engine >= 0 and r.req_id in held:
            keep.append(r)
    if len(keep) != len(held):
        held.intersection_update(r.req_id for r in keep)
    for r in keep:
        out[r.engine].append(r)
    for rs in out.values():
        rs.sort(key=_req_id)
    return out


def _req_id(r: Request) -> int:
    return r.req_id


def held_by_engine(v: Views, st: Shared) -> dict[int, list[int]]:
    return {e: [r.req_id for r in rs] for e, rs in held_requests(v, st).items()}


def snapshots(v: Views, st: Shared, block_size: int, budget: float) -> dict[int, InstanceSnap]:
    """The coordinator's snapshot of every instance, each engine's reported counters validated by Eq. 1."""
    held = held_requests(v, st)
    out = {}
    for e in v.engines:
        reqs = held[e.engine]
        running = [r for r in reqs if r.state == "running"]
        ids = tuple(r.req_id for r in running)
        reported = e.running + e.waiting
        M = (e.kv_used + e.kv_free) * block_size if e.kv_used + e.kv_free > 0 else budget
        if reported == len(running) and reported == e.assigned and not e.loading and (e.kv_used or not reqs):
            snap = InstanceSnap(e.engine, e.version, e.running, e.waiting, float(e.kv_used * block_size), M,
                                e.loading, ids)
        else:
            kv = sum(r.prompt_len + r.tokens for r in running)
            snap = InstanceSnap(e.engine, e.version, len(running), 0, float(kv), M, e.loading, ids)
        out[e.engine] = snap
    return out


class Member:
    """Mixed into every StaleFlow mechanism: its `eta` is the preset's staleness bound (the controller enforces the
    smallest one declared), it reaches the shared state through `state(v)`, and it checkpoints the buffers (every
    member saves the same; the first to run after a resume restores them)."""
    p: Any
    _st: Shared | None = None
    _restore: dict[str, Any] | None = None

    def staleness_bound(self) -> int | None:
        return int(self.p.eta)

    def state(self, v: Views) -> Shared:
        if self._restore is not None:
            if KEY not in v.shared:
                v.shared[KEY] = Shared(StalenessBuffers.from_state_dict(self._restore))
            self._restore = None
        self._st = shared(v, int(self.p.eta))
        return self._st

    def state_dict(self) -> dict[str, Any]:
        return {} if self._st is None else {"buffers": self._st.buffers.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restore = state.get("buffers") or None

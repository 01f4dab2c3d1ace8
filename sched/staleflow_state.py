"""What StaleFlow's mechanisms share through `Views.shared["staleflow"]` (§3, §5.1-5.2): the staleness manager's
buffers (sched/staleness.py), the trajectory store (TS) and the coordinator's validated snapshot. One object,
created by whichever StaleFlow module runs first; each module checks that its eta matches.

How the paper's pieces map onto ours:
- Trajectory store = the controller's pending requests. An initial trajectory is a pending request never admitted
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


class TSQueue:
    """The TS in MLQ order, read lazily: the head (every trajectory with a finite priority: partial ones and
    unrouted members of reserved groups, a few hundred at most) is built at once; the tail (initial trajectories of
    groups not reserved when the queue was taken, usually thousands, in request-id order) is built only as far as a
    reader iterates, and remembered, so routing that withholds after a few dozen never touches the rest.

    Iterate it within the decision call that took it (the tail reads the controller's pending index live; nothing
    changes request states while a policy decides). Reading it yields exactly the list the eager sort would."""

    def __init__(self, v: Views, st: Shared):
        loc, buf = st.buffers.loc, st.buffers.buf
        self._reserved = set(loc)           # groups reserved when the queue was taken (routing adds to loc)
        gprio: dict[int, float] = {}
        buckets: dict[float, list[Item]] = {}
        for r in v.requests.iter_pending():
            vt = r.v_traj
            if vt >= 0:
                prio: float = vt
            else:
                gid = r.group_id
                if gid not in loc:
                    continue                # tail
                prio = gprio.get(gid)  # type: ignore[assignment]
                if prio is None:
                    at = loc[gid]
                    prio = gprio[gid] = buf[at[0]][at[1]].v  # type: ignore[union-attr]
            b = buckets.get(prio)
            if b is None:
                buckets[prio] = [_item(r, prio)]
            else:
                b.append(_item(r, prio))
        self.head: list[Item] = [it for p in sorted(buckets) for it in buckets[p]]
        self._tail: list[Item] = []
        self._src = v.requests.iter_pending()
        self._done = False

    def _more(self) -> Item | None:
        if self._done:
            return None
        inf, reserved = float("inf"), self._reserved
        for r in self._src:
            if r.v_traj < 0 and r.group_id not in reserved:
                it = _item(r, inf)
                self._tail.append(it)
                return it
        self._done = True
        return None

    def fresh(self) -> bool:
        """Is there any initial trajectory of an unreserved group?"""
        return bool(self._tail) or self._more() is not None

    def __iter__(self):
        yield from self.head
        i = 0
        while True:
            if i < len(self._tail):
                yield self._tail[i]
            elif self._more() is None:
                return
            else:
                continue
            i += 1

    def materialize(self) -> list[Item]:
        return list(self)


def _item(r: Request, prio: float) -> Item:
    part = r.partial
    vt = r.v_traj
    if part is not None:
        vs = part.versions
        if not vs:
            need = max(vt, 0)
        else:
            runs = getattr(vs, "runs", None)        # run-length encoded (sim.tokens.RunList): max over its runs
            need = max(v for v, _ in runs) if runs is not None else max(vs)
        return Item(r, prio, r.prompt_len + len(part.response_ids), need)
    return Item(r, prio, r.prompt_len, max(vt, 0))


def ts_items(v: Views, st: Shared) -> TSQueue:
    """The TS in MLQ order: by V_traj (partial) or group version (unrouted members of reserved groups), initial
    trajectories of new groups last; FIFO (request id) within a queue. An iterable (TSQueue), built lazily."""
    return TSQueue(v, st)


def routable(buffers: StalenessBuffers, it: Item, s: InstanceSnap) -> bool:
    """Alg. 2 check_routable, with a tentative V_traj (no side effect): an initial trajectory needs a slot
    for the instance's version (its group's window if the group is reserved), a partial one an instance version
    at least its V_traj and its newest token's. An instance without weights or mid-Pull takes nothing (§5.2: a
    Route to an instance executing a Pull waits for it)."""
    if s.version < 0 or s.loading:
        return False
    if it.initial:
        return buffers.admits(it.req.group_id, s.version)
    return s.version >= it.need


class TSSummary:
    """What Alg. 4's eligibility test needs of the whole TS, computed once per pass: is ANY TS trajectory
    routable to an instance of version u? (O(1) per instance instead of O(TS).)"""

    def __init__(self, buffers: StalenessBuffers, items: "list[Item] | TSQueue"):
        self.buffers = buffers
        if isinstance(items, TSQueue):      # the tail is initial trajectories of unreserved groups: only ask if any
            head, self.fresh = items.head, items.fresh()
        else:
            head = items
            self.fresh = any(it.initial and buffers.where(it.req.group_id) is None for it in items)
        self.need = min((it.need for it in head if not it.initial), default=None)
        wheres = [w for it in head if it.initial and (w := buffers.where(it.req.group_id)) is not None]
        self.oldest = min(wheres, default=None)

    def any_routable(self, s: InstanceSnap) -> bool:
        if s.version < 0 or s.loading:
            return False
        u = s.version
        return ((self.need is not None and u >= self.need) or (self.fresh and self.buffers.can_assign(u))
                or (self.oldest is not None and u <= self.buffers.v_next and u + self.buffers.eta >= self.oldest))


def commit(buffers: StalenessBuffers, it: Item, version: int) -> None:
    """Reserve (first member of a group) or join its group's entry, at the routed instance's version."""
    if it.initial:
        buffers.join(it.req.group_id, version)


def ts_intake(v: Views, st: Shared, ts_groups: int) -> int:
    """Prompts to pull: a round of `prompts_per_step` whenever fewer than `ts_groups` groups wait unreserved."""
    B = int(v.params["prompts_per_step"])
    cap = ts_groups or (st.eta + 1) * B
    loc = st.buffers.loc
    waiting = {r.group_id for r in v.requests.iter_pending() if r.v_traj < 0}
    waiting = {g for g in waiting if g not in loc}
    return B if len(waiting) + B <= cap else 0


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

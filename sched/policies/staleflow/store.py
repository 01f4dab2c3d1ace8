"""StaleFlow's trajectory store (TS, §5.1) as the routing strategies read it: the controller's pending requests in
multi-level-queue order (Alg. 3: by V_traj, or the reserved group's version, initial trajectories of unreserved
groups last), Alg. 2's routability check with a tentative V_traj, the Reserve that commits a routing, and the TS
intake that keeps `ts_groups` unreserved groups waiting.

The TS is the controller's pending requests: an initial trajectory is a pending request never admitted
(`v_traj == -1`); an interrupted one is pending again with its tokens in `partial` and its `v_traj` kept.
"""
from __future__ import annotations

from dataclasses import dataclass

from sched.policies.staleflow.buffers import StalenessBuffers
from sched.policies.staleflow.cost import InstanceSnap
from sched.views import Request, Views


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


class TSQueue:
    """The TS in MLQ order, read lazily: the head (every trajectory with a finite priority: partial ones and
    unrouted members of reserved groups, a few hundred at most) is built at once; the tail (initial trajectories of
    groups not reserved when the queue was taken, usually thousands, in request-id order) is built only as far as a
    reader iterates, and remembered, so routing that withholds after a few dozen never touches the rest. Both are
    read from the controller's pending index split by admission (`RequestTable.fresh_by_group`, `resumed_pending`),
    so taking the queue costs what its head holds and the reserved groups, not every pending request.

    Iterate it within the decision call that took it (the tail reads the controller's pending index live; nothing
    changes request states while a policy decides). Reading it yields exactly the list the eager sort would.
    Members of the groups in `skip` (being aborted by the staleness manager) are not in the TS."""

    def __init__(self, v: Views, buffers: StalenessBuffers, skip: set[int] | frozenset[int] = frozenset()):
        loc, buf = buffers.loc, buffers.buf
        self._reserved = set(loc) | skip    # groups reserved when the queue was taken (routing adds to loc)
        fresh = v.requests.fresh_by_group()
        head = [_item(r, r.v_traj) for r in v.requests.resumed_pending() if r.group_id not in skip]
        for gid, (b, i) in loc.items():     # initial trajectories of reserved groups: at their group's version
            members = fresh.get(gid)
            if members and gid not in skip:
                prio = buf[b][i].v  # type: ignore[union-attr]
                head += [_item(r, prio) for r in members.values()]
        head.sort(key=_mlq_order)
        self.head: list[Item] = head
        self._tail: list[Item] = []
        # the rest in request-id order: a group's requests have consecutive ids, so by group id, then by id
        self._src = (r for gid in sorted(fresh) if gid not in self._reserved for r in fresh[gid].values())
        self._done = False

    def _more(self) -> Item | None:
        if self._done:
            return None
        for r in self._src:
            it = _item(r, float("inf"))
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


def _mlq_order(it: Item) -> tuple[float, int]:
    """MLQ order: by priority (V_traj, or the reserved group's version), FIFO (request id) within a queue."""
    return it.prio, it.req.req_id


def _item(r: Request, prio: float) -> Item:
    part = r.partial
    vt = r.v_traj
    if part is not None:
        need = part.newest_version if part.versions else max(vt, 0)
        return Item(r, prio, r.prompt_len + len(part.response_ids), need)
    return Item(r, prio, r.prompt_len, max(vt, 0))


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


def ts_intake(v: Views, buffers: StalenessBuffers, ts_groups: int) -> int:
    """Prompts to pull: a round of `prompts_per_step` whenever fewer than `ts_groups` groups wait unreserved
    (default (eta + 1) x batch, §5.1's capacity, counted in groups: the unit the paper leaves open; with batch
    redundancy, (eta + 1) x the buffer's entries)."""
    B = v.prompts_per_step
    cap = ts_groups or (buffers.eta + 1) * (B + buffers.extra)
    loc = buffers.loc
    waiting = sum(1 for g in v.requests.fresh_by_group() if g not in loc)
    return B if waiting + B <= cap else 0

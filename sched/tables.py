"""The indexed tables behind `Views.requests` and `Views.groups` (sched/views.py; `GroupTable` in
sched/group_table.py, the request table's per-engine index in sched/engine_index.py): mappings that also keep indexes,
so policies read the pending queue, the running set, the open or the ready groups in time proportional to what
they read, not to every request of every live round.

The indexes follow insertions and removals by themselves; a change of a field they depend on is announced
explicitly by the one writer, the request lifecycle (sched/lifecycle.py): `RequestTable.set_state` for a request's
state (a request's engine is set before it enters an on-engine state and cleared after it left one),
`RequestTable.set_tool` for its tool wait, `GroupTable.track` after a group's scored / dropped / consumed counts
changed. Both are full
`MutableMapping`s over a private dict, so every way of inserting or removing (`update`, `setdefault`, `pop`, ...)
goes through the indexing `__setitem__` / `__delitem__`.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Hashable, Iterable, Iterator, Sequence

from sched.engine_index import EngineIndex

if TYPE_CHECKING:
    from sched.views import Request


_req_id = attrgetter("req_id")


class IndexedTable(MutableMapping):
    """A mapping over a private dict `_all`; reading it costs what reading a dict costs (the dict's own views).
    Subclasses index what they hold in `__setitem__` / `__delitem__` / `clear`."""
    _all: dict[int, Any]

    def __getitem__(self, key: int) -> Any:
        return self._all[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, key: object) -> bool:
        return key in self._all

    def get(self, key: int, default: Any = None) -> Any:
        return self._all.get(key, default)

    def keys(self):
        return self._all.keys()

    def values(self):
        return self._all.values()

    def items(self):
        return self._all.items()


class RequestTable(IndexedTable):
    """req_id -> Request, with an index of the requests in each of the `indexed` states (the non-final ones); the
    `queue` state's index is read in request-id order (the pending queue). The queue is also indexed split in two:
    its requests never admitted to an engine (`v_traj < 0`), by group, and those admitted before (interrupted,
    requeued or taken back), so a policy that treats the two apart reads each without scanning the other.
    `v_traj` changes only on admission, as the request leaves the queue.

    The requests in any of the `on_engine` states with an engine (`engine >= 0`) are also indexed by engine
    (`on_engine`, read in id order), each engine's entry with a change stamp (`engine_stamp`) that moves whenever a
    request enters or leaves it, changes state within it, or starts or stops waiting on a tool (`set_tool`), so a
    policy may keep what it derived from an engine's requests until the stamp moves."""

    def __init__(self, indexed: Sequence[Hashable], queue: Hashable, on_engine: Sequence[Hashable] = ()):
        self._all: dict[int, Request] = {}
        self._by_state: dict[Hashable, dict[int, Request]] = {s: {} for s in indexed}
        self._queue = queue
        self._sorted = True       # the queue's index is in id order
        self._fresh: dict[int, dict[int, Request]] = {}   # group id -> its queued requests never admitted, by id
        self._resumed: dict[int, Request] = {}            # queued requests admitted before
        self._on = tuple(on_engine)
        self._engines = EngineIndex()   # the requests in an `on_engine` state with an engine (sched/engine_index.py)

    def __setitem__(self, req_id: int, r: "Request") -> None:
        old = self._all.get(req_id)
        if old is not None:
            self._unindex(old)
            self._engines.remove(old)
        self._all[req_id] = r
        self._index(r)
        if r.engine >= 0 and r.state in self._on:
            self._engines.add(r)

    def __delitem__(self, req_id: int) -> None:
        r = self._all.pop(req_id)
        self._unindex(r)
        self._engines.remove(r)

    def clear(self) -> None:
        self._all.clear()
        for idx in self._by_state.values():
            idx.clear()
        self._sorted = True
        self._fresh.clear()
        self._resumed.clear()
        self._engines.clear()

    # ---------------------------------------------------------------------------------------------- the index
    def set_state(self, r: "Request", state: Hashable) -> None:
        """Move request r to `state`, keeping the index in step (the only way a state changes)."""
        on = self._on
        was = r.engine >= 0 and r.state in on
        now = r.engine >= 0 and state in on
        if was and not now:
            self._engines.remove(r)
        old = r.state
        self._unindex(r)
        r.state = state
        self._index(r)
        if now:
            if was:                 # a change of state on the same engine
                self._engines.moved(r, old)
            else:
                self._engines.add(r)

    def set_tool(self, r: "Request", since: float) -> None:
        """r starts (`since` >= 0: when) or stops (-1) waiting on a tool call."""
        r.tool_since = since
        if r.engine >= 0 and r.state in self._on:
            self._engines.touch(r.engine)

    def _unindex(self, r: "Request") -> None:
        idx = self._by_state.get(r.state)
        if idx is not None:
            idx.pop(r.req_id, None)
        if r.state == self._queue:    # by id and group, not by v_traj: admission sets it before the state changes
            if self._resumed.pop(r.req_id, None) is None:
                members = self._fresh.get(r.group_id)
                if members is not None and members.pop(r.req_id, None) is not None and not members:
                    del self._fresh[r.group_id]

    def _index(self, r: "Request") -> None:
        idx = self._by_state.get(r.state)
        if idx is None:
            return
        if r.state == self._queue:
            if idx and r.req_id < next(reversed(idx)):
                self._sorted = False
            if r.v_traj >= 0:
                self._resumed[r.req_id] = r
            else:
                members = self._fresh.setdefault(r.group_id, {})
                in_order = not members or r.req_id > next(reversed(members))
                members[r.req_id] = r
                if not in_order:
                    self._fresh[r.group_id] = dict(sorted(members.items()))
        idx[r.req_id] = r

    def set_tokens(self, progress: dict) -> None:
        """Each listed request's response tokens so far (an engine's progress report; ids may be JSON strings);
        ids no longer held are skipped. Not indexed, so no index changes."""
        get = self._all.get
        for rid, n in progress.items():
            r = get(rid)                    # an int id (the simulator's reports): as get(int(rid))
            if r is not None:
                r.tokens = n
            elif type(rid) is not int and (r := get(int(rid))) is not None:
                r.tokens = n

    def iter_pending(self) -> Iterator["Request"]:
        """The queue (pending requests) in id order, without a copy: change no request's state while iterating
        (use `pending()` for a list)."""
        if not self._sorted:
            self._by_state[self._queue] = dict(sorted(self._by_state[self._queue].items()))
            self._sorted = True
        return iter(self._by_state[self._queue].values())

    def pending(self) -> list["Request"]:
        return list(self.iter_pending())

    def fresh_by_group(self) -> dict[int, dict[int, "Request"]]:
        """The pending requests never admitted to an engine (`v_traj < 0`): group id -> {req_id: request} in id
        order, groups in insertion order (the caller sorts them if it needs to); read only, and change no request's
        state while reading."""
        return self._fresh

    def resumed_pending(self) -> list["Request"]:
        """The pending requests admitted before (`v_traj >= 0`: interrupted, requeued, taken back), in id order."""
        return sorted(self._resumed.values(), key=_req_id)

    def on_engine(self, engine: int) -> Iterable["Request"]:
        """The requests on `engine` (in an `on_engine` state) in id order, without a copy: change no request's
        state while iterating."""
        return self._engines.members(engine)

    def count_on(self, engine: int, state: Hashable) -> int:
        """How many requests on `engine` are in `state` (one of the `on_engine` states)."""
        return self._engines.count(engine, state)

    def engine_stamp(self, engine: int) -> int:
        """A stamp of `engine`'s entry in the per-engine index: equal stamps, equal requests in equal states and
        tool waits (0: nothing entered it since the table was made or cleared)."""
        return self._engines.stamp(engine)

    def in_state(self, *states: Hashable) -> list["Request"]:
        """Requests in any of these indexed states, state by state, each in the order it entered that state
        (a state that is not indexed is an error)."""
        return [r for s in states for r in self._by_state[s].values()]

    def count(self, *states: Hashable) -> int:
        return sum(len(self._by_state[s]) for s in states)

    def check(self) -> None:
        """Raise AssertionError if an index disagrees with the requests' states (tests call it)."""
        for s, idx in self._by_state.items():
            for req_id, r in idx.items():
                assert self._all.get(req_id) is r and r.state == s, f"request {req_id} indexed as {s}, is {r.state}"
        for r in self._all.values():
            idx = self._by_state.get(r.state)
            assert idx is None or idx.get(r.req_id) is r, f"request {r.req_id} ({r.state}) missing from its index"
        queue = self._by_state[self._queue]
        fresh = {i: r for members in self._fresh.values() for i, r in members.items()}
        assert fresh.keys() | self._resumed.keys() == queue.keys() and not fresh.keys() & self._resumed.keys(), \
            "the queue's split index out of step"
        assert all(r.v_traj < 0 and r.group_id == g and list(m) == sorted(m) for g, m in self._fresh.items()
                   for r in m.values()), "a fresh entry admitted before, in another group or out of id order"
        assert all(r.v_traj >= 0 for r in self._resumed.values()), "a resumed entry never admitted"
        self._engines.check({i: r for i, r in self._all.items() if r.engine >= 0 and r.state in self._on})


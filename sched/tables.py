"""The indexed tables behind `Views.requests` and `Views.groups` (sched/views.py): plain dicts that also keep
indexes in step with every change of the fields they depend on (Request.state; GroupState.scored / dropped /
consumed / size), whoever makes it, so policies read the pending queue, the running set, the open or the ready
groups in time proportional to what they read, not to every request of every live round.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from sched.views import GroupState, Request

IN_FLIGHT = ("pending", "running", "aborting", "requeueing", "interrupting")


class RequestTable(dict):
    """`Views.requests`: a dict req_id -> Request that also indexes the requests of every non-final state, so
    policies read the pending queue (or the running set) in time proportional to it, not to every request of every
    live round. The index follows each `state` assignment, whoever makes it (Request.__setattr__)."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__()
        self._by_state: dict[str, dict[int, Request]] = {s: {} for s in IN_FLIGHT}
        self._sorted = True       # the pending index is in id order
        for k, r in dict(*args, **kw).items():
            self[k] = r

    def __setitem__(self, key: int, r: Request) -> None:
        old = self.get(key)
        if old is not None and old is not r:
            self._untrack(old)
        object.__setattr__(r, "_table", self)
        super().__setitem__(key, r)
        self._track(r, r.state)

    def __delitem__(self, key: int) -> None:
        self._untrack(self[key])
        super().__delitem__(key)

    def pop(self, key: int, *default: Any) -> Any:
        if key in self:
            self._untrack(self[key])
        return super().pop(key, *default)

    def _untrack(self, r: Request) -> None:
        idx = self._by_state.get(r.state)
        if idx is not None:
            idx.pop(r.req_id, None)

    def _track(self, r: Request, state: str) -> None:
        old = self._by_state.get(r.__dict__.get("state", ""))
        if old is not None:
            old.pop(r.req_id, None)
        idx = self._by_state.get(state)
        if idx is None:
            return
        if state == "pending" and idx and r.req_id < next(reversed(idx)):
            self._sorted = False
        idx[r.req_id] = r

    def iter_pending(self) -> Iterator[Request]:
        """Pending requests in id order (the order they were created: group by group), without a copy: change no
        request's state while iterating (use `pending()` for a list)."""
        if not self._sorted:
            self._by_state["pending"] = dict(sorted(self._by_state["pending"].items()))
            self._sorted = True
        return iter(self._by_state["pending"].values())

    def pending(self) -> list[Request]:
        return list(self.iter_pending())

    def in_state(self, *states: str) -> list[Request]:
        """Requests in any of these non-final states (a state outside IN_FLIGHT is not indexed: an error)."""
        return [r for s in states for r in self._by_state[s].values()]

    def count(self, *states: str) -> int:
        return sum(len(self._by_state[s]) for s in states)


class GroupTable(dict):
    """`Views.groups`: a dict group_id -> GroupState that also indexes the open (not closed) and the ready
    (materialised, not consumed) groups, following every change of the fields they depend on."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__()
        self._open: dict[int, GroupState] = {}
        self._ready: dict[int, GroupState] = {}
        for k, g in dict(*args, **kw).items():
            self[k] = g

    def __setitem__(self, key: int, g: GroupState) -> None:
        old = self.get(key)
        if old is not None and old is not g:
            self._open.pop(key, None)
            self._ready.pop(key, None)
        object.__setattr__(g, "_table", self)
        super().__setitem__(key, g)
        self._track(g)

    def __delitem__(self, key: int) -> None:
        self._open.pop(key, None)
        self._ready.pop(key, None)
        super().__delitem__(key)

    def pop(self, key: int, *default: Any) -> Any:
        self._open.pop(key, None)
        self._ready.pop(key, None)
        return super().pop(key, *default)

    def _track(self, g: GroupState) -> None:
        for idx, member in ((self._open, not g.closed), (self._ready, g.materialized and not g.consumed)):
            if member:
                idx[g.group_id] = g
            else:
                idx.pop(g.group_id, None)

    def open(self) -> list[GroupState]:
        return [self._open[k] for k in sorted(self._open)]

    def ready(self) -> list[GroupState]:
        return [self._ready[k] for k in sorted(self._ready)]

"""`Views.groups`' table (sched/tables.py has the shared base and the request table): group_id -> GroupState with
indexes of the open and the ready groups, kept by `track`, which the request lifecycle calls after a group's scored /
dropped / consumed counts changed."""
from __future__ import annotations

from typing import TYPE_CHECKING

from sched.tables import IndexedTable

if TYPE_CHECKING:
    from sched.views import GroupState


class GroupTable(IndexedTable):
    """group_id -> GroupState, with indexes of the open (not closed) and the ready (materialised, not consumed)
    groups, re-evaluated on insertion and on `track`."""

    def __init__(self) -> None:
        self._all: dict[int, GroupState] = {}
        self._open: dict[int, GroupState] = {}
        self._ready: dict[int, GroupState] = {}

    def __setitem__(self, group_id: int, g: "GroupState") -> None:
        self._open.pop(group_id, None)
        self._ready.pop(group_id, None)
        self._all[group_id] = g
        self.track(g)

    def __delitem__(self, group_id: int) -> None:
        del self._all[group_id]
        self._open.pop(group_id, None)
        self._ready.pop(group_id, None)

    def clear(self) -> None:
        self._all.clear()
        self._open.clear()
        self._ready.clear()

    def track(self, g: "GroupState") -> None:
        """Re-evaluate group g's index membership after its scored / dropped / consumed counts changed."""
        gid = g.group_id
        if g.closed:
            self._open.pop(gid, None)
        else:
            self._open[gid] = g
        if g.materialized and not g.consumed:
            self._ready[gid] = g
        else:
            self._ready.pop(gid, None)

    def check(self) -> None:
        """Raise AssertionError if an index disagrees with the groups' counts (tests call it)."""
        for g in self._all.values():
            assert (g.group_id in self._open) == (not g.closed), f"group {g.group_id}: open index out of step"
            assert (g.group_id in self._ready) == (g.materialized and not g.consumed), \
                f"group {g.group_id}: ready index out of step"

    def open(self) -> list["GroupState"]:
        return [self._open[k] for k in sorted(self._open)]

    def ready(self) -> list["GroupState"]:
        return [self._ready[k] for k in sorted(self._ready)]

    def count_ready(self) -> int:
        return len(self._ready)

"""The request table's per-engine index (sched/tables.py `RequestTable`): the requests on each engine, by id, with a
count per (engine, state) and a change stamp per engine.

The table calls `add` / `remove` as a request enters or leaves an on-engine state with an engine, `moved` when it
changes state on the same engine, and `touch` when anything else a policy derives from an engine's requests changes
(a tool wait). A stamp moves at every such change and never repeats (across indexes and clears), so a policy may keep
what it derived from an engine's requests until the engine's stamp moves.
"""
from __future__ import annotations

import itertools
from collections import Counter
from typing import TYPE_CHECKING, Hashable, Iterable

if TYPE_CHECKING:
    from sched.views import Request

_stamps = itertools.count(1)


class EngineIndex:
    def __init__(self) -> None:
        self._engines: dict[int, dict[int, Request]] = {}  # engine -> its requests in an on-engine state, by id
        self._unsorted: set[int] = set()                    # engines whose entry is not in id order
        self._stamp: dict[int, int] = {}                    # engine -> stamp of its entry's last change
        self._counts: dict[tuple[int, Hashable], int] = {}  # (engine, state) -> its requests in that state

    def clear(self) -> None:
        self._engines.clear()
        self._unsorted.clear()
        self._counts.clear()
        self._stamp = {e: next(_stamps) for e in self._stamp}

    def add(self, r: "Request") -> None:
        e = r.engine
        members = self._engines.get(e)
        if members is None:
            members = self._engines[e] = {}
        elif members and r.req_id < next(reversed(members)):
            self._unsorted.add(e)
        members[r.req_id] = r
        key = (e, r.state)
        self._counts[key] = self._counts.get(key, 0) + 1
        self._stamp[e] = next(_stamps)

    def remove(self, r: "Request") -> None:
        members = self._engines.get(r.engine)
        if members is not None and members.pop(r.req_id, None) is not None:
            self._counts[r.engine, r.state] -= 1
            self._stamp[r.engine] = next(_stamps)

    def moved(self, r: "Request", old: Hashable) -> None:
        """r, still on its engine, went from state `old` to `r.state`."""
        self._counts[r.engine, old] -= 1
        key = (r.engine, r.state)
        self._counts[key] = self._counts.get(key, 0) + 1
        self._stamp[r.engine] = next(_stamps)

    def touch(self, engine: int) -> None:
        self._stamp[engine] = next(_stamps)

    def members(self, engine: int) -> Iterable["Request"]:
        """The requests on `engine` in id order, without a copy."""
        members = self._engines.get(engine)
        if members is None:
            return ()
        if engine in self._unsorted:
            members = self._engines[engine] = dict(sorted(members.items()))
            self._unsorted.discard(engine)
        return members.values()

    def count(self, engine: int, state: Hashable) -> int:
        return self._counts.get((engine, state), 0)

    def stamp(self, engine: int) -> int:
        return self._stamp.get(engine, 0)

    def check(self, held: dict[int, "Request"]) -> None:
        """Raise AssertionError unless the index holds exactly `held` (req_id -> request, every request of the table
        in an on-engine state with an engine)."""
        indexed = {i for members in self._engines.values() for i in members}
        assert indexed == held.keys(), "the per-engine index out of step"
        counts = Counter((r.engine, r.state) for m in self._engines.values() for r in m.values())
        assert all(self._counts.get(k, 0) == n for k, n in counts.items()) and \
            all(n == counts.get(k, 0) for k, n in self._counts.items()), "the per-engine state counts out of step"
        assert all(r.engine == e and held.get(i) is r for e, m in self._engines.items() for i, r in m.items()), \
            "a per-engine entry on another engine or not in the table"
        assert all(list(m) == sorted(m) for e, m in self._engines.items() if e not in self._unsorted), \
            "a per-engine entry out of id order unmarked"

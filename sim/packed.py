"""A simulated run's events packed to travel between processes: the reproductions' pool (sim/repro/core.py) ships
each simulation's result from a forked worker to the process computing the rows. Only results this process tree
made are ever unpacked (never a file or a socket), so the pickle here reads nothing from outside."""
from __future__ import annotations

import pickle
from operator import attrgetter
from typing import Any

from sched.events import Event


class PackedEvents:
    """A run's events packed to travel between processes (a reproduction's pool ships each simulation's result):
    per kind, the fields of its events (FIELDS; the in-process `payload` left out, as in the log) as columns in one
    pickled blob, and the log order as one byte per event. A process that receives it unpickles a kind only when
    that kind is first read (`select`): rows read a few kinds of a log of ~10^5-10^6 events, and the per-request
    kinds they seldom read are most of its bytes. Kinds are not re-validated: they were when the events were made."""
    FIELDS = ("t", "rank", "engine", "req_id", "group_id", "version", "data")
    __slots__ = ("kinds", "order", "blobs", "end_t", "_made")

    def __init__(self, events: list[Event], only: frozenset[str] | None = None):
        """`only`: the kinds to carry (None: all); the others are left out."""
        index: dict[str, int] = {}
        per: list[list[Event]] = []
        order = bytearray()
        for e in events:
            k = index.get(e.kind)
            if k is None:
                k = index[e.kind] = len(per) if only is None or e.kind in only else -1   # -1: left out
                if k >= 0:
                    if k == 256:
                        raise ValueError("more than 256 event kinds: the log order keeps one byte per event")
                    per.append([])
            if k >= 0:
                order.append(k)
                per[k].append(e)
        self.kinds = tuple(kind for kind, k in index.items() if k >= 0)
        self.order = bytes(order)
        self.blobs = tuple(pickle.dumps(tuple(list(map(attrgetter(f), evs)) for f in self.FIELDS),
                                        pickle.HIGHEST_PROTOCOL) for evs in per)
        self.end_t: float | None = max(e.t for e in events) if events else None   # the latest event time
        self._made: dict[int, list[Event]] = {}

    def __getstate__(self) -> tuple:
        return self.kinds, self.order, self.blobs, self.end_t

    def __setstate__(self, state: tuple) -> None:
        self.kinds, self.order, self.blobs, self.end_t = state
        self._made = {}

    def _of_kind(self, k: int) -> list[Event]:
        """The events of the k-th kind, in log order, made from its blob once."""
        out = self._made.get(k)
        if out is None:
            kind, new = self.kinds[k], object.__new__
            out = []
            append = out.append
            for t, rank, engine, req_id, group_id, version, data in zip(*pickle.loads(self.blobs[k]), strict=True):
                e = new(Event)      # slot by slot, without __init__'s defaults and check
                e.kind, e.t, e.rank, e.engine, e.req_id = kind, t, rank, engine, req_id
                e.group_id, e.version, e.data, e.payload = group_id, version, data, None
                append(e)
            self._made[k] = out
        return out

    def select(self, kinds: frozenset[str] | None = None) -> list[Event]:
        """The events of these kinds (None: all), in log order."""
        ks = [k for k, name in enumerate(self.kinds) if kinds is None or name in kinds]
        if len(ks) <= 1:
            return list(self._of_kind(ks[0])) if ks else []
        its: list[Any] = [None] * len(self.kinds)
        for k in ks:
            its[k] = iter(self._of_kind(k)).__next__
        order = self.order if len(ks) == len(self.kinds) else \
            self.order.translate(None, bytes(k for k in range(len(self.kinds)) if its[k] is None))
        return [its[k]() for k in order]

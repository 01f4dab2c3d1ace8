"""A virtual clock with an event queue: the simulator's only notion of time.

Items are popped in time order; items pushed for the same instant come out in push order, so a run is a pure
function of its inputs and seed (no ties broken by object identity or hashing).
"""
from __future__ import annotations

import heapq
from typing import Any


class EventQueue:
    """Min-heap of (time, push sequence number, item) on a clock that only moves forward."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = 0
        self.now = 0.0

    def push(self, t: float, item: Any) -> None:
        if t < self.now - 1e-9:
            raise ValueError(f"cannot schedule into the past: t={t} < now={self.now}")
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self.now), self._seq, item))

    def pop(self) -> tuple[float, Any]:
        """Remove the earliest item and move the clock to its time."""
        t, _, item = heapq.heappop(self._heap)
        self.now = t
        return t, item

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)

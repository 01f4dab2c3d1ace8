"""Blocking work moved off a rank's main loop, so its engine keeps decoding meanwhile: jobs run one at a time, in
the order submitted, on one background thread, and their results come back to the main loop in that order.

    jobs = InOrder("kv-receiver")
    jobs.submit(key, fn, *args)       queue fn(*args) and return at once (the thread starts at the first job)
    jobs.take()                       [(key, result)] of the jobs done since the last look; never blocks
    jobs.wait_all(what, on)           the rest, after waiting for them: a declared wait (runtime/watchdog.py) on
                                      the ranks `on`, so a frozen peer ends the job with a report naming `what`
    jobs.close(what, on)              wait_all, then stop the thread

Each job's own blocking calls declare their waits too (they run on the thread, which the watchdog tracks like
any other). A job that raises stops the thread; the error, with its traceback, is raised at the next call.
Users: a migrated request's KV leaving and arriving (runtime/kv_transfer.py KVSender, KVReceiver) and a
publication arriving into the relay (runtime/relay.py).
"""
from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from runtime.watchdog import Phase, waiting

_FAILED = object()


class InOrder:
    def __init__(self, name: str):
        self.name = name
        self.inbox: queue.Queue[tuple[Hashable, Callable[..., Any], tuple] | None] = queue.Queue()
        self.done: queue.Queue[tuple[Hashable, Any]] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.error: str | None = None
        self.pending: list[Hashable] = []   # keys submitted and not yet handed over, in order

    def submit(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> None:
        self._raise()
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()
        self.pending.append(key)
        self.inbox.put((key, fn, args))

    def _run(self) -> None:
        while (item := self.inbox.get()) is not None:
            key, fn, args = item
            try:
                result = fn(*args)
            except BaseException:
                self.error = traceback.format_exc()
                self.done.put((key, _FAILED))
                return
            self.done.put((key, result))

    def take(self) -> list[tuple[Hashable, Any]]:
        out: list[tuple[Hashable, Any]] = []
        while True:
            try:
                item = self.done.get_nowait()
            except queue.Empty:
                break
            self._hand_over(item, out)
        return out

    def wait_all(self, what: str, on: Sequence[int], phase: Phase | None = None, step: int = 0
                 ) -> list[tuple[Hashable, Any]]:
        out = self.take()
        if self.pending:
            with waiting(what, on=on, phase=phase, step=step):
                while self.pending:
                    self._hand_over(self.done.get(), out)
        return out

    JOIN_S = 30.0   # how long a thread with nothing left to do may take to end

    def close(self, what: str, on: Sequence[int]) -> list[tuple[Hashable, Any]]:
        out = self.wait_all(what, on) if self.thread is not None else []
        if self.thread is not None:
            self.inbox.put(None)
            self.thread.join(self.JOIN_S)
            if self.thread.is_alive():
                raise RuntimeError(f"{self.name}: its thread did not end within {self.JOIN_S} s with no job left")
            self.thread = None
        return out

    def _hand_over(self, item: tuple[Hashable, Any], out: list) -> None:
        key, result = item
        if result is _FAILED:
            self._raise()
        self.pending.remove(key)
        out.append(item)

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"{self.name} failed:\n{self.error}")

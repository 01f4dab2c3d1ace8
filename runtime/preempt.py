"""Graceful preemption: a signal from the cluster's scheduler (SIGTERM, and any of `cluster.preempt_signals`) makes
every rank stop at the next safe point, after a checkpoint, and leave with exit code 75 (PREEMPTED_EXIT_CODE).

How a signal travels. `install` (main thread, once the process groups exist) gives each signal a Python handler
and routes it through `signal.set_wakeup_fd`, so a rank blocked in a gloo or NCCL call (where Python handlers wait
for the call to return) still sees it at once: a watcher thread reads the wakeup pipe, records the request, and
writes it into torchrun's store; the same thread polls the store, so a signal that reaches one rank only (a
scheduler that signals one process, `kill` by hand) reaches every rank within POLL_S. torchrun forwards its own
SIGTERM to every worker, so usually each rank sees one of its own. torchrun also SIGTERMs the ranks left when one
has died: a SIGTERM while a rank on this host has exited, and before any request, keeps its old meaning (the rank
leaves at once, exit code 143), so a crash still ends the job as fast as before.

The safe point. Only the leader acts on a request: its controller's after-event hook (runtime/rundir.py
`periodic_checkpoints`) waits for the same moment a periodic checkpoint does (the trainer holds no work: nothing
training, no gradients accumulated), saves one there and raises `Preempted`, which ends the controller's loop
without the final save or export. The leader then stops the engines and the train ranks as at the end of a run,
every rank passes the shutdown barrier and returns PREEMPTED_EXIT_CODE, and rank 0 prints one line naming the
checkpoint and the command that resumes from it (`checkpoint.resume=latest`, sched/resume.py: nothing lost).
The engines decode until the leader's stop: the controller may need their results to reach the safe point.

The deadline. `cluster.preempt_grace_s` after the first request, a rank still running leaves anyway, with the same
exit code (os._exit: threads blocked in a collective cannot hold the process). A checkpoint write it cuts short
leaves only its temporary directory (trainer/checkpoint.py writes atomically): the last complete checkpoint stays
the one a restart resumes from. Under torchrun, set `--shutdown_timeout` above the grace period (its default, 30 s,
is when torchrun SIGKILLs workers that it has signalled).
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch.distributed as dist

PREEMPTED_EXIT_CODE = 75   # EX_TEMPFAIL (sysexits.h): a temporary failure, run the same command again to resume
POLL_S = 0.2               # how often the watcher looks at the store for another rank's request
KEY = "tidal/preempt"            # the first request's reason, for every rank
STOPPED = "tidal/preempted"      # set by the leader once it has stopped the run early for a request


SKEW_S = 3 * POLL_S        # ranks' grace deadlines fall within about POLL_S of each other (a loaded host: more)


class Preempted(Exception):
    """Raised by the leader's after-event hook once the preemption checkpoint is saved: the controller's loop ends."""


@dataclass
class Preemption:
    """One rank's view of a preemption request: the first one wins; `grace_s` runs from it."""
    grace_s: float
    clock: Callable[[], float] = time.monotonic
    reason: str = ""
    at: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def requested(self) -> bool:
        return self.at is not None

    def request(self, reason: str) -> bool:
        """Record a request; True when it is the first."""
        with self.lock:
            if self.at is not None:
                return False
            self.at, self.reason = self.clock(), reason
            return True

    def left_s(self) -> float:
        """Seconds left of the grace period (inf before any request)."""
        return float("inf") if self.at is None else self.grace_s - (self.clock() - self.at)

    def expired(self) -> bool:
        return self.left_s() <= 0


def await_deadline(preemption: Preemption | None) -> None:
    """Called as a rank's role ends in an error: when this rank's grace deadline is at most SKEW_S away, the error is
    most likely the other ranks leaving at theirs (a collective cut under it), so wait for its own, where the
    watcher ends the process with PREEMPTED_EXIT_CODE like theirs; otherwise return at once (the error is reported).
    Bounded: the deadline plus two polls."""
    left = preemption.left_s() if preemption is not None else float("inf")
    if left <= SKEW_S:
        time.sleep(max(0.0, left) + 2 * POLL_S)


def safe_point_hook(preemption: Preemption | None, at_safe_point: Callable[[], bool], save: Callable[[], None],
                    saved_now: Callable[[], bool] = lambda: False) -> Callable[[], None]:
    """The check the leader's after-event hook runs last: under a request, at a safe point, save (unless a periodic
    checkpoint was just saved at this same event: `saved_now`) and raise Preempted."""
    def check() -> None:
        if preemption is None or not preemption.requested or not at_safe_point():
            return
        if not saved_now():
            save()
        mark_stopped(preemption.reason)
        raise Preempted(preemption.reason)
    return check


class Watcher:
    """The thread that turns a signal (through the wakeup pipe) or another rank's request (through the store) into
    this rank's request, and ends the process when the grace period is over."""

    def __init__(self, preemption: Preemption, signums: set[int], rank: int, store: dist.Store | None, read_fd: int,
                 exit_fn: Callable[[int], None] = os._exit, peers_gone: Callable[[], list[int]] = list):
        self.p, self.signums, self.rank, self.store = preemption, signums, rank, store
        self.read_fd, self.exit_fn, self.peers_gone = read_fd, exit_fn, peers_gone
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="preempt", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 10 * POLL_S) -> None:
        """Stop the loop and wait (a deadline) for the thread to leave it: a daemon thread still inside a store call
        when the process exits aborts it (C++ `terminate`), as the store's client is destroyed under it."""
        self.stopped.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout_s)

    def _loop(self) -> None:
        while not self.stopped.is_set():
            self.step(POLL_S)

    def adopt(self) -> bool:
        """Take another rank's request from the store, if there is one."""
        if self.store is None:
            return False
        try:
            if self.store.check([KEY]):
                return self.p.request(self.store.get(KEY).decode())
        except Exception:   # the store's host is gone: the job is ending anyway
            pass
        return False

    def announce(self) -> None:
        """Put this rank's request in the store; the first rank to do so (torchrun signals them all) says so."""
        first = True
        if self.store is not None:
            try:   # the first rank's reason is kept
                first = self.store.compare_set(KEY, "", self.p.reason).decode() == self.p.reason
            except Exception:   # the store's host is gone: the job is ending anyway
                pass
        if first:
            print(f"preemption: {self.p.reason}: every rank stops at the next safe point, after a checkpoint "
                  f"(within cluster.preempt_grace_s = {self.p.grace_s:g}s)", file=sys.stderr, flush=True)

    def step(self, wait_s: float) -> None:
        """One round: a signal that arrived, else another rank's request in the store; then the deadline."""
        ready, _, _ = select.select([self.read_fd], [], [], wait_s)
        if ready:
            try:
                data = os.read(self.read_fd, 64)
            except BlockingIOError:
                data = b""
            for num in data:
                if num not in self.signums:   # another handled signal (SIGINT's KeyboardInterrupt) also writes here
                    continue
                name = signal.Signals(num).name if num in signal.Signals._value2member_map_ else f"signal {num}"
                if self.p.requested or self.adopt():
                    continue
                if num == signal.SIGTERM and self.peers_gone():   # torchrun stopping the ranks left after one
                    self.exit_fn(128 + num)                         # died: its SIGTERM keeps its old meaning
                    self.stopped.set()
                    return
                if self.p.request(f"{name} on rank {self.rank}"):
                    self.announce()
        elif not self.p.requested:
            self.adopt()
        if self.p.expired():
            if self.rank == 0:   # every rank's deadline falls within POLL_S of the others': one line
                print(f"preempted ({self.p.reason}): no checkpoint within cluster.preempt_grace_s = "
                      f"{self.p.grace_s:g}s; every rank leaves with exit code {PREEMPTED_EXIT_CODE}, a restart "
                      f"resumes from the last complete checkpoint", file=sys.stderr, flush=True)
            self.exit_fn(PREEMPTED_EXIT_CODE)
            self.stopped.set()


_state: tuple[Preemption, Watcher, list[tuple[int, object]], int] | None = None


def install(signals: list[str], grace_s: float, rank: int, store: dist.Store | None,
            peers_gone: Callable[[], list[int]] = list) -> Preemption | None:
    """Catch `signals` on this rank (main thread only) and start the watcher; None when `signals` is empty.
    `peers_gone`: the ranks on this host whose process has exited (runtime/watchdog.py `gone_ranks`): a SIGTERM
    while one has, and before any request, is torchrun stopping the job after a failure, and ends this rank at once
    (exit code 143), as it did before preemption was handled."""
    global _state
    if not signals:
        return None
    preemption = Preemption(grace_s)
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    previous = []
    for name in signals:
        num = getattr(signal, name)
        previous.append((num, signal.signal(num, lambda *_: None)))   # the wakeup pipe carries it to the watcher
    watcher = Watcher(preemption, {num for num, _ in previous}, rank, store, r, peers_gone=peers_gone)
    watcher.start()
    _state = (preemption, watcher, previous, old_fd)
    return preemption


def uninstall() -> None:
    """Stop watching (the process groups are going); the signals' previous handlers come back, unless a request
    came: then this rank leaves with PREEMPTED_EXIT_CODE and ignores the signals from here on (torchrun SIGTERMs the
    ranks still in their teardown when the first one leaves; the interpreter's own teardown would reset a Python
    handler to the fatal default, not SIG_IGN)."""
    global _state
    if _state is None:
        return
    preemption, watcher, previous, old_fd = _state
    watcher.stop()
    _state = None
    if preemption.requested:
        for num, _ in previous:
            signal.signal(num, signal.SIG_IGN)
        return
    for num, handler in previous:
        signal.signal(num, handler)
    signal.set_wakeup_fd(old_fd)


def mark_stopped(reason: str) -> None:
    """The leader stopped the run early for a request: every rank will leave with PREEMPTED_EXIT_CODE (`seen`)."""
    if _state is not None and _state[1].store is not None:
        _state[1].store.set(STOPPED, reason)


def seen(store: dist.Store | None) -> str:
    """The request's reason if the leader stopped the run early for it, else '' (a request that came after the
    controller's last step lets the run finish as usual): what every rank asks after the shutdown barrier."""
    if _state is None or store is None:
        return ""
    try:
        return store.get(STOPPED).decode() if store.check([STOPPED]) else ""
    except Exception:   # the store's host is gone: the leader did not pass the barrier either
        return ""


def resume_line(run_dir: str, checkpoint: str | None, argv: list[str], reason: str) -> str:
    """The one line rank 0 prints on a preempted exit."""
    import shlex
    args = [a for a in argv if not a.startswith(("--checkpoint.resume=", "--log.dir="))]
    cmd = "torchrun ... train.py " + " ".join(shlex.quote(a) for a in args + [f"--log.dir={run_dir}",
                                                                              "--checkpoint.resume=latest"])
    saved = f"checkpoint {checkpoint} saved" if checkpoint else "no checkpoint saved"
    return f"preempted ({reason}): {saved}; exit code {PREEMPTED_EXIT_CODE}; resume with: {cmd}"

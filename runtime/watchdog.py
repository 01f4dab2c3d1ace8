"""Deadlines for every blocking call, tied to progress: a frozen, dead or hung rank ends the job with a report.

Gloo and NCCL calls cannot be cancelled from Python, and one call cannot tell a slow peer from a dead one, so no
blocking call carries its own timer. Instead every blocking call is declared where it is made:

    with watchdog.waiting("a work item from the leader (rank 0)", on=[0]):        # an idle wait
        item = broadcast_item(None, topo)
    with watchdog.waiting(f"train step {n}", on=train_ranks, phase=Phase.TRAIN, step=n):   # a work wait
        trainer.train_step(...)                        # its collectives; trainer.progress reports each micro-batch

and the work that moves a run forward reports itself with `progress(...)` (an engine step, a micro-batch, a weight
bucket, a checkpoint stage, an event the controller applied). Each rank runs one watchdog thread that beats into
torchrun's store every `timeout_s / 10` (at most 2 s): a sequence number, how long ago the rank last made progress,
and what each of its threads is doing. From the beats of the ranks it watches (the leader watches every rank; the
others watch the leader and the ranks they are waiting on) it applies two rules, the deadlines of the runtime:

- **silent**: a rank with no new beat for `timeout_s` is frozen or dead (SIGSTOP, a hung driver that stopped the
  process, a lost node). The rank that notices writes its report and, if the silent rank runs on its own host,
  SIGKILLs it (a stopped process cannot act on torchrun's SIGTERM; torchrun would wait 30 s before its SIGKILL).
- **no progress**: a wait expires when it has lasted `timeout_s` and none of the ranks it waits on has made progress
  in the last `timeout_s`. A work wait (phase set: the collectives of a train step, a publication, a checkpoint) is
  renewed by progress in that work on a rank that is in it, or by any progress of a rank not in it yet (it is on its
  way, e.g. an engine finishing its step before it joins the broadcast); an idle wait (a message, a work item, a
  command) by any progress of those ranks, including the progress of whatever they are waiting on in turn (each
  rank's beat carries its "effective" quiet time: its own, or that of its waits if shorter). So a slow rank never
  expires a deadline, whatever a call's length, as long as each unit of its work (one engine step, one micro-batch,
  one bucket, one checkpoint stage) takes less than `timeout_s`; a hung one (alive, heartbeats going, no progress)
  expires it. A wait on ranks that are themselves only waiting defers two beats, and a wait on a rank whose beats
  are overdue defers to the silent rule, so the report comes from the rank closest to the fault.

When a rule fires, the rank writes RUN_DIR/stall-rank{R}.txt (`.restart{N}` added in a torchrun restart): the
silent or stuck ranks with what they were doing, what this rank was doing, and every thread's stack; prints one
line; and leaves with exit code 3 (os._exit: threads blocked in gloo cannot hold the process). torchrun then ends
the job (and restarts it under --max-restarts). An exception that ends a rank's role goes the same way (`failed`):
RUN_DIR/failed-rank{R}.txt names the ranks on this host whose process died (a SIGKILLed peer reaches the others as
a broken connection), then the traceback; exit code 1. A fatal signal (segfault, abort) dumps every thread's stack to
RUN_DIR/fatal-rank{R}.txt through faulthandler. Without an installed watchdog (unit tests) the declarations are
kept but nothing watches them. Fault injection for tests (runtime/faults.py) rides on `progress` (`on_progress`).
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO, Callable, Iterator, Sequence

import torch.distributed as dist

STALL_EXIT_CODE = 3
# A SIGKILLed peer's sockets close while its process exits: the broken connection can reach this rank before /proc
# shows the peer gone (seen on a fast host). A failing rank that finds no dead peer looks again for this long.
PEER_EXIT_GRACE_S = 1.0
KEY = "tidal/watchdog/"


class Phase(str, Enum):
    """The work a rank is in; a work wait is renewed only by progress in the same work (see the module docstring)."""
    DECODE = "decode"            # a rollout rank's engine steps
    PUBLISH = "publish"          # a weight publication: gather on the train ranks, broadcast to the rollout ranks
    TRAIN = "train"              # a train step (FSDP2 collectives)
    CHECKPOINT = "checkpoint"    # a checkpoint save
    EXPORT = "export"            # the HF export


@dataclass
class Activity:
    """What one thread is doing: its own work (`on` is None) or a wait on the ranks `on` (empty: on nobody)."""
    what: str
    on: tuple[int, ...] | None
    phase: Phase | None
    step: int
    t0: float
    note: str = ""            # the latest progress report made inside it

    def describe(self, now: float) -> str:
        kind = "doing" if self.on is None else "in" if self.phase is not None else "waiting for"
        return f"{kind} {self.what} for {now - self.t0:.1f}s" + (f" (last progress: {self.note})" if self.note else "")


# --------------------------------------------------------------------------------------- this process's state
_lock = threading.Lock()
_threads: dict[int, tuple[str, list[Activity]]] = {}    # thread id -> (thread name, its activities, innermost last)
_last_progress = time.monotonic()
_phase_progress: dict[Phase, float] = {}
_dog: "Watchdog | None" = None
_on_progress: Callable[[Phase, int], None] | None = None   # set by `on_progress` (runtime/faults.py)


@contextmanager
def _activity(act: Activity) -> Iterator[Activity]:
    tid = threading.get_ident()
    with _lock:
        stack = _threads.setdefault(tid, (threading.current_thread().name, []))[1]
        stack.append(act)
        if act.phase is not None:
            _phase_progress[act.phase] = act.t0   # entering a work counts as progress in it
    try:
        yield act
    finally:
        with _lock:
            stack.remove(act)
            if not stack:
                _threads.pop(tid, None)


def doing(what: str, phase: Phase | None = None, step: int = 0) -> AbstractContextManager[Activity]:
    """This thread's own work (no deadline of its own: the ranks waiting on this one watch its progress)."""
    return _activity(Activity(what, None, phase, step, time.monotonic()))


def waiting(what: str, on: Sequence[int], phase: Phase | None = None, step: int = 0
            ) -> AbstractContextManager[Activity]:
    """A blocking wait on the ranks `on` (this rank may be one of them), with the deadline rule of the module
    docstring; `on` empty: a plain deadline of timeout_s."""
    return _activity(Activity(what, tuple(sorted(set(on))), phase, step, time.monotonic()))


def progress(note: str = "") -> None:
    """The calling thread moved its work forward; the `on_progress` hook (fault injection) is called here."""
    global _last_progress
    now = time.monotonic()
    phased = None
    with _lock:
        _last_progress = now
        entry = _threads.get(threading.get_ident())
        if entry is not None:
            entry[1][-1].note = note
            phased = next((a for a in reversed(entry[1]) if a.phase is not None), None)
            if phased is not None:
                _phase_progress[phased.phase] = now
    hook = _on_progress
    if hook is not None and phased is not None:
        hook(phased.phase, phased.step)


def on_progress(hook: Callable[[Phase, int], None] | None) -> None:
    """Call `hook(phase, step)` at each progress report made inside a phased work, on the reporting thread, until
    `uninstall` (None: no hook). Test fault injection (runtime/faults.py) is the one user."""
    global _on_progress
    _on_progress = hook


def _snapshot() -> list[tuple[str, list[Activity]]]:
    """(thread name, its activities, innermost last) of every thread that declared one."""
    with _lock:
        return [(name, list(stack)) for name, stack in _threads.values()]


def _describe(threads: list[tuple[str, list[Activity]]], now: float) -> str:
    """Each thread's innermost activity (what it is blocked in, or the work it is doing)."""
    return "; ".join(f"[{name}] {stack[-1].describe(now)}" for name, stack in threads) or \
        "nothing declared (between calls)"


# ------------------------------------------------------------------------------------------------ the watchdog
@dataclass
class Peer:
    """Another rank as its beats show it."""
    seq: int = -1
    seen: float = 0.0            # monotonic time at which this rank saw its current beat first
    quiet: float = 0.0           # its effective quiet time when it beat
    phase_quiet: dict[str, float] | None = None
    phases: tuple[str, ...] = ()
    blocked: bool = False        # only waiting (no work of its own in progress)
    done: bool = False           # left the run cleanly
    doing: str = ""


@dataclass
class Verdict:
    headline: str
    details: list[str]
    fence: list[int]


class Watchdog:
    def __init__(self, run_dir: str | Path | None, rank: int, world: int, roles: list[str], store: dist.Store,
                 timeout_s: float):
        self.run_dir, self.rank, self.world, self.roles = run_dir, rank, world, roles
        self.store, self.timeout_s = store, timeout_s
        self.beat_s = min(max(timeout_s / 10, 0.05), 2.0)
        self.peers: dict[int, Peer] = {}
        self.info: dict[int, dict] = {}
        self.seq = 0
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    # ---- beats ---------------------------------------------------------------------------------------------
    def own_quiet(self, now: float) -> float:
        return now - _last_progress

    def peer_quiet(self, r: int, now: float, phase: Phase | None) -> float:
        """How long rank r has made no progress (in `phase` when it is in that work), as its last beat shows."""
        p = self.peers.get(r)
        if p is None:
            return 0.0
        base = p.quiet
        if phase is not None and phase.value in p.phases and p.phase_quiet is not None:
            base = p.phase_quiet.get(phase.value, base)
        return base + (now - p.seen)

    def on_quiet(self, a: Activity, now: float) -> float:
        """How long none of the ranks the wait `a` is on has made progress (infinite for a wait on nobody)."""
        q = float("inf")
        for r in a.on or ():
            if r == self.rank:
                mine = _phase_progress.get(a.phase) if a.phase is not None else _last_progress
                q = min(q, now - (mine if mine is not None else a.t0))
            else:
                q = min(q, self.peer_quiet(r, now, a.phase))
        return q

    def wait_quiet(self, a: Activity, now: float) -> float:
        """How long the wait `a` has gone unrenewed: never longer than it has lasted."""
        return min(now - a.t0, self.on_quiet(a, now))

    def beat(self, now: float) -> None:
        threads = _snapshot()
        waits = [a for _, stack in threads for a in stack if a.on is not None]
        quiet = min([self.own_quiet(now)] + [self.on_quiet(a, now) for a in waits])  # progress passed along waits
        with _lock:
            phase_quiet = {p.value: now - t for p, t in _phase_progress.items()}
        self.seq += 1
        self.store.set(KEY + f"beat/{self.rank}", json.dumps({
            "seq": self.seq, "quiet": quiet, "phase_quiet": phase_quiet,
            "phases": sorted({a.phase.value for _, stack in threads for a in stack if a.phase is not None}),
            "blocked": bool(threads) and all(stack[-1].on is not None for _, stack in threads),
            "doing": _describe(threads, now)}))

    def watched(self) -> list[int]:
        ranks = set(range(self.world)) if self.rank == 0 else {0}
        for _, stack in _snapshot():
            for a in stack:
                ranks |= set(a.on or ())
        return sorted(r for r in ranks if r != self.rank and not self.peers.get(r, Peer()).done)

    def read(self, ranks: list[int], now: float) -> None:
        if not ranks:
            return
        for r, raw in zip(ranks, self.store.multi_get([KEY + f"beat/{r}" for r in ranks])):
            b = json.loads(raw)
            p = self.peers.setdefault(r, Peer(seen=now))
            if b["seq"] != p.seq:
                p.seq, p.seen = b["seq"], now
                p.quiet, p.phase_quiet = b["quiet"], b["phase_quiet"]
                p.phases, p.blocked, p.doing = tuple(b["phases"]), b["blocked"], b["doing"]
                p.done = b.get("done", False)

    # ---- rules ---------------------------------------------------------------------------------------------
    def check(self, now: float) -> Verdict | None:
        d = self.timeout_s
        for r in self.watched():
            p = self.peers.get(r)
            if p is not None and now - p.seen >= d:
                return Verdict(f"rank {r} ({self.role(r)}) sent no heartbeat for {now - p.seen:.1f}s: frozen or "
                               f"dead", [f"its last heartbeat said: {p.doing}"], fence=[r])
        for name, a in [(name, a) for name, stack in _snapshot() for a in stack]:
            if a.on is None:
                continue
            q = self.wait_quiet(a, now)
            others = [r for r in a.on if r != self.rank]
            overdue = [r for r in others if (p := self.peers.get(r)) is not None and not p.done
                       and now - p.seen > 2 * self.beat_s]
            if overdue:   # they may be frozen: the silent rule decides, within timeout_s
                continue
            blocked = others and all(self.peers.get(r, Peer()).blocked for r in others)
            if q < d + (2 * self.beat_s if blocked else 0.0):
                continue
            ranks = ", ".join(map(str, a.on)) if a.on else "nobody in particular"
            details = [f"rank {r} ({self.role(r)}): alive, no progress for {self.peer_quiet(r, now, a.phase):.1f}s; "
                       f"it was: {self.peers[r].doing}" for r in others if r in self.peers]
            return Verdict(f"waited {now - a.t0:.1f}s for {a.what} [{name}]; no progress from rank(s) {ranks} in "
                           f"the last {d:g}s", details, fence=[])
        return None

    def role(self, r: int) -> str:
        return self.roles[r] if 0 <= r < len(self.roles) else "?"

    # ---- firing --------------------------------------------------------------------------------------------
    def fire(self, v: Verdict) -> None:
        """Write the stall report, fence what is frozen on this host, leave the process (never returns)."""
        lines = [f"rank {self.rank} ({self.role(self.rank)}) stopped the job: {v.headline}"] + v.details
        lines += [self.fence(r) for r in v.fence]
        self.leave("stall", lines, STALL_EXIT_CODE)

    def fail(self, error: str) -> None:
        """An exception ended this rank's role: name the ranks on this host whose process is gone (a crash there
        reaches this rank as a broken connection; PEER_EXIT_GRACE_S for its exit to show), then leave like `fire`
        (never returns)."""
        deadline = time.monotonic() + PEER_EXIT_GRACE_S
        while not (gone := [r for r in range(self.world) if r != self.rank and self.process_gone(r)]) and \
                time.monotonic() < deadline:
            time.sleep(0.02)
        cause = "; ".join(f"rank {r} ({self.role(r)}) died: its process (pid {self.info[r]['pid']}) is gone"
                          for r in gone) or "an error in this rank: " + error.strip().splitlines()[-1]
        self.leave("failed", [f"rank {self.rank} ({self.role(self.rank)}) stopped the job: {cause}", error.rstrip()],
                   1)

    def leave(self, kind: str, lines: list[str], code: int) -> None:
        """RUN_DIR/{kind}-rank{R}.txt: `lines`, what this rank was doing, every thread's stack; one line to stderr;
        os._exit(code) (threads blocked in gloo cannot hold the process)."""
        lines = lines + [f"rank {self.rank} was: {_describe(_snapshot(), time.monotonic())}"]
        msg = "\n".join(lines)
        path = report_path(self.run_dir, kind, self.rank)
        if path is not None:
            try:
                with open(path, "w") as f:
                    f.write(msg + "\n\n")
                    f.flush()
                    faulthandler.dump_traceback(f, all_threads=True)
                msg += f"\n(stacks of every thread: {path})"
            except OSError as e:
                msg += f"\n(could not write {path}: {e})"
        print("error: " + msg, file=sys.stderr, flush=True)
        os._exit(code)

    def process_gone(self, r: int) -> bool:
        """Whether rank r's process, on this host, has exited (reaped, or a zombie torchrun has not reaped yet)."""
        info = self.info.get(r, {})
        if info.get("host") != socket.gethostname():
            return False
        try:
            stat = Path(f"/proc/{info['pid']}/stat").read_text()
        except OSError:
            return True
        return stat[stat.rindex(")") + 2] in "ZX"

    def fence(self, r: int) -> str:
        """SIGKILL a silent rank's process when it runs on this host and is still that rank of this job."""
        info = self.info.get(r, {})
        pid, host = info.get("pid"), info.get("host")
        if pid is None or host != socket.gethostname():
            return f"rank {r} runs on {host or 'another host'}: left to torchrun"
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            return f"rank {r} (pid {pid}) is gone"
        mine = os.environ
        if env.get("RANK") != str(r) or env.get("MASTER_PORT") != mine.get("MASTER_PORT") or \
                env.get("TORCHELASTIC_RESTART_COUNT") != mine.get("TORCHELASTIC_RESTART_COUNT"):
            return f"pid {pid} is no longer rank {r} of this job: not killed"
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError as e:
            return f"could not kill rank {r} (pid {pid}): {e}"
        return f"killed rank {r} (pid {pid} on this host), so that torchrun need not wait out its SIGTERM grace"

    # ---- the thread ----------------------------------------------------------------------------------------
    def start(self) -> None:
        global _last_progress
        _last_progress = time.monotonic()   # the watch begins: start-up is not silence
        self.store.set(KEY + f"info/{self.rank}", json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        self.beat(time.monotonic())
        dist.barrier()  # the default group (start-up deadline, topology.STARTUP_MIN_S): every first beat is in
        raw = self.store.multi_get([KEY + f"info/{r}" for r in range(self.world)])
        self.info = {r: json.loads(b) for r, b in enumerate(raw)}
        self.thread = threading.Thread(target=self._loop, name="watchdog", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while not self.stopped.wait(self.beat_s):
                now = time.monotonic()
                self.beat(now)
                self.read(self.watched(), now)
                verdict = self.check(now)
                if verdict is not None and not self.stopped.is_set():
                    self.fire(verdict)
        except Exception as e:   # the store (torchrun's agent) is gone, or a bug here: nothing would watch
            if not self.stopped.is_set():
                self.fire(Verdict(f"the watchdog failed ({type(e).__name__}: {e}); torchrun's store may be gone",
                                  [], fence=[]))

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()
        self.store.set(KEY + f"beat/{self.rank}", json.dumps({"seq": self.seq + 1, "quiet": 0.0, "phase_quiet": {},
                                                              "phases": [], "blocked": False, "done": True,
                                                              "doing": "left the run"}))


def report_path(run_dir: str | Path | None, kind: str, rank: int) -> Path | None:
    """RUN_DIR/{kind}-rank{R}.txt, with .restart{N} before .txt in a job torchrun restarted."""
    if run_dir is None:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    return Path(run_dir) / (f"{kind}-rank{rank}" + (f".restart{attempt}" if attempt != "0" else "") + ".txt")


_fatal_file: IO[str] | None = None


def install(run_dir: str | Path, rank: int, world: int, roles: list[str], store: dist.Store, timeout_s: float
            ) -> None:
    """Start this rank's watchdog (collective: every rank calls it once the process groups exist), and dump every
    thread's stack to RUN_DIR/fatal-rank{R}.txt if the process dies on a fatal signal."""
    global _dog, _fatal_file
    _fatal_file = open(report_path(run_dir, "fatal", rank), "w")
    faulthandler.enable(_fatal_file, all_threads=True)
    _dog = Watchdog(run_dir, rank, world, roles, store, timeout_s)
    _dog.start()


def rank_info() -> dict[int, dict]:
    """Every rank's pid and host, from the installed watchdog's start-up exchange ({} without one)."""
    return dict(_dog.info) if _dog is not None else {}


def gone_ranks() -> list[int]:
    """The other ranks on this host whose process has exited ([] without a watchdog)."""
    return [r for r in _dog.info if r != _dog.rank and _dog.process_gone(r)] if _dog is not None else []


def failed(error: str) -> None:
    """An exception ended the rank's role (`error`: its traceback): report it, naming the ranks whose process died,
    and leave with exit code 1 at once (never returns)."""
    if _dog is not None:
        _dog.fail(error)
    print(error, file=sys.stderr, flush=True)
    os._exit(1)


def uninstall() -> None:
    """Clean exit: stop watching (peers see this rank as done), remove the empty fatal-signal file."""
    global _dog, _fatal_file, _on_progress
    _on_progress = None
    if _dog is not None:
        _dog.stop()
        _dog = None
    if _fatal_file is not None:
        faulthandler.disable()
        _fatal_file.close()
        path = Path(_fatal_file.name)
        if path.exists() and path.stat().st_size == 0:
            path.unlink()
        _fatal_file = None

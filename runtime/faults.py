"""Fault injection for tests (tests/runtime/test_fault_matrix.py): freeze, kill, hang or slow a rank at a chosen phase
of a real run, one plan per torchrun attempt, so one `torchrun --max-restarts=N` job walks through a list of faults.

    TIDAL_FAULTS="freeze 2 decode 1; kill 1 train 2; ; slow 1 train 2 1.0 & slow 2 decode 3 1.2"

Plans are separated by ';', the i-th for attempt i (TORCHELASTIC_RESTART_COUNT); attempts past the list, and empty
plans, run clean. A plan is faults joined by '&', each `KIND RANK PHASE STEP [SECONDS]`:

    freeze   SIGSTOP the whole process of RANK (every thread stops, as a hung driver or a frozen node would)
    kill     SIGKILL RANK (a machine fault: no cleanup, no report)
    hang     RANK's thread stops for good where it reports progress; the process stays alive and keeps beating
    slow     RANK sleeps SECONDS at each of its progress reports in PHASE at step STEP (a slow but alive rank)
    fail     RANK's engine fails (`EngineFault`, raised by its next engine step: a failure its rank may isolate,
             Laminar §3.3) from its STEP-th decode progress report on (about its STEP-th engine step:
             mid-generation, where a weight version would fall between batches), once; it cannot be rebuilt for
             SECONDS (default 0) after

PHASE is a runtime.watchdog.Phase (decode, publish, train, checkpoint, export); a fault other than `fail` fires at
the first progress report (runtime/watchdog.progress) made in that phase at a step >= STEP: decode counts the
engine's weight version, train the step being trained, publish the version published, checkpoint the step saved.
freeze and kill fire on whichever rank reports first (once per job attempt, through torchrun's store) and signal
RANK's process wherever it is, as `kill -STOP` from outside would: RANK need not be in that phase itself (a train
rank frozen while the engines decode). hang, slow and fail act on RANK's own reports. Each firing prints one line to
stderr ("fault injection: ...").

train.py arms a rank's plan with `install` once its watchdog runs: the injector rides on the watchdog's progress
reports (`watchdog.on_progress`), and the rollout worker raises a due `fail` inside its engine step
(`injected_engine_fault`, runtime/engine_health.py).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from enum import Enum

import torch.distributed as dist

from runtime import watchdog
from runtime.watchdog import KEY, Phase


class Kind(str, Enum):
    FREEZE = "freeze"
    KILL = "kill"
    HANG = "hang"
    SLOW = "slow"
    FAIL = "fail"


class EngineFault(RuntimeError):
    """An injected engine failure; `down_s`: how long the engine cannot be rebuilt after it."""

    def __init__(self, msg: str, down_s: float = 0.0):
        super().__init__(msg)
        self.down_s = down_s


@dataclass(frozen=True)
class Fault:
    kind: Kind
    rank: int
    phase: Phase
    step: int
    seconds: float = 0.0

    def __str__(self) -> str:
        extra = (f" ({self.seconds:g}s per progress report)" if self.kind is Kind.SLOW else
                 f" (down {self.seconds:g}s)" if self.kind is Kind.FAIL else "")
        return f"{self.kind.value} rank {self.rank} at {self.phase.value} step {self.step}{extra}"


def parse(spec: str) -> list[list[Fault]]:
    """TIDAL_FAULTS -> one list of faults per attempt; ValueError naming the bad entry."""
    plans = []
    for plan in spec.split(";"):
        faults = []
        for entry in filter(None, (e.strip() for e in plan.split("&"))):
            words = entry.split()
            try:
                kind, rank, phase, step = Kind(words[0]), int(words[1]), Phase(words[2]), int(words[3])
                seconds = float(words[4]) if kind is Kind.SLOW or (kind is Kind.FAIL and len(words) == 5) else 0.0
                if len(words) != (5 if kind is Kind.SLOW else 4) and not (kind is Kind.FAIL and len(words) == 5):
                    raise IndexError
                if kind is Kind.FAIL and phase is not Phase.DECODE:
                    raise ValueError
            except (ValueError, IndexError):
                raise ValueError(f"TIDAL_FAULTS: cannot read {entry!r}; expected 'KIND RANK PHASE STEP [SECONDS]' "
                                 f"with KIND in {[k.value for k in Kind]}, PHASE in {[p.value for p in Phase]}, "
                                 f"SECONDS for slow (and optionally fail, whose PHASE is decode)") from None
            faults.append(Fault(kind, rank, phase, step, seconds))
        plans.append(faults)
    return plans


class Injector:
    def __init__(self, faults: list[Fault], rank: int, store: dist.Store):
        self.faults, self.rank, self.store = faults, rank, store
        self.pids: dict[int, int] = {}
        self.fired: set[int] = set()
        self.decode_reports = 0   # this rank's progress reports in the decode phase (what `fail` counts)
        self.engine_fault: EngineFault | None = None   # a `fail` that fired, until the engine's step takes it

    @classmethod
    def from_env(cls, rank: int, store: dist.Store) -> "Injector | None":
        spec = os.environ.get("TIDAL_FAULTS")
        if not spec:
            return None
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        plans = parse(spec)
        faults = plans[attempt] if attempt < len(plans) else []
        return cls(faults, rank, store) if faults else None

    def bind(self, info: dict[int, dict]) -> None:
        """Every rank's pid (from the watchdog's start-up exchange): freeze and kill signal another rank's process."""
        self.pids = {r: i["pid"] for r, i in info.items()}

    def at(self, phase: Phase, step: int) -> None:
        """A progress report of this rank in `phase` at `step`: fire what is due."""
        self.decode_reports += phase is Phase.DECODE
        for i, f in enumerate(self.faults):
            if f.phase is not phase or i in self.fired:
                continue
            if f.kind is Kind.SLOW:
                if f.rank == self.rank and step == f.step:
                    time.sleep(f.seconds)
                continue
            if f.kind is Kind.FAIL:
                if f.rank == self.rank and self.decode_reports >= f.step:
                    self.fired.add(i)
                    announce(f, self.rank)
                    self.engine_fault = EngineFault(f"injected engine failure ({f})", f.seconds)
                continue
            if step < f.step:
                continue
            if f.kind is Kind.HANG:
                if f.rank == self.rank:
                    self.fired.add(i)
                    announce(f, self.rank)
                    while True:
                        time.sleep(3600)
                continue
            self.fired.add(i)
            if self.store.add(KEY + f"fault/{i}", 1) != 1:   # another rank fired it first
                continue
            announce(f, self.rank)
            os.kill(self.pids[f.rank], signal.SIGSTOP if f.kind is Kind.FREEZE else signal.SIGKILL)

    def take_engine_fault(self) -> "EngineFault | None":
        """The `fail` fault that fired and is not yet raised, once (`injected_engine_fault`)."""
        fault, self.engine_fault = self.engine_fault, None
        return fault


def announce(f: Fault, by: int) -> None:
    print(f"fault injection: {f} (fired by rank {by} at {time.time():.3f})", file=sys.stderr, flush=True)


_injector: Injector | None = None   # this rank's armed plan (`install`)


def install(injector: Injector | None) -> None:
    """Arm this rank's plan (None: a clean attempt) after `watchdog.install`: freeze and kill signal the pids of the
    watchdog's start-up exchange, and every fault fires at this rank's progress reports (`watchdog.progress`)."""
    global _injector
    _injector = injector
    if injector is not None:
        injector.bind(watchdog.rank_info())
    watchdog.on_progress(injector.at if injector is not None else None)


def injected_engine_fault() -> Exception | None:
    """An engine failure this rank's plan made due at its last progress report (`fail`), once: the rollout worker
    raises it inside its engine step, where a real one would come from (runtime/engine_health.py)."""
    return _injector.take_engine_fault() if _injector is not None else None

"""The deadline rules of runtime/watchdog.py, on a watchdog fed with made-up heartbeats at made-up times: idle waits
renewed by the progress of the ranks they wait on (and of what those wait on), work waits only by progress in that
work, silent ranks named and fenced, deferral to the rank closest to the fault; the stall report; fault plans
(runtime/faults.py). The same rules on real processes, SIGSTOP included: tests/runtime/test_fault_matrix.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from runtime import faults, watchdog
from runtime.faults import Fault, Injector, Kind, parse
from runtime.watchdog import KEY, Phase, Watchdog, waiting

D = 5.0
ROLES = ["train leader, controller", "train", "rollout, engine 0"]


class FakeStore:
    def __init__(self):
        self.kv: dict[str, bytes] = {}

    def set(self, key, value):
        self.kv[key] = value.encode() if isinstance(value, str) else value

    def multi_get(self, keys):
        return [self.kv[k] for k in keys]

    def add(self, key, n):
        self.kv[key] = str(int(self.kv.get(key, b"0")) + n).encode()
        return int(self.kv[key])


def beat(store, rank, seq, quiet=0.0, phase_quiet=None, phases=(), blocked=False, doing="[MainThread] x"):
    store.set(KEY + f"beat/{rank}", json.dumps({"seq": seq, "quiet": quiet, "phase_quiet": phase_quiet or {},
                                                "phases": list(phases), "blocked": blocked, "doing": doing}))


def dog(rank: int, run_dir=None) -> Watchdog:
    return Watchdog(run_dir, rank, 3, ROLES, FakeStore(), D)


def tick(w: Watchdog, now: float, **beats) -> watchdog.Verdict | None:
    """Rank r beats (seq, quiet, ...) as given, this rank reads them at `now` and applies its rules."""
    for r, (seq, kw) in beats.items():
        beat(w.store, int(r[1:]), seq, **kw)
    w.read(w.watched(), now)
    return w.check(now)


def test_an_idle_wait_is_renewed_by_progress_however_long_it_lasts():
    w = dog(1)
    with waiting("a work item from the leader (rank 0)", on=[0]) as a:
        for k in range(40):   # 20 s, four deadlines: the leader keeps making progress
            assert tick(w, a.t0 + 0.5 * k, r0=(k, dict(quiet=0.3))) is None


def test_a_wait_expires_when_none_of_its_ranks_progresses_and_names_them():
    w = dog(1)
    with waiting("a work item from the leader (rank 0)", on=[0]) as a:
        verdicts = [tick(w, a.t0 + 0.5 * k, r0=(k, dict(quiet=0.5 * k, doing="[MainThread] doing the loop")))
                    for k in range(12)]
    assert verdicts[:10] == [None] * 10    # alive (beating) but no progress: expires at the deadline, not before
    v = verdicts[10]
    assert v.headline.startswith("waited 5.0s for a work item from the leader (rank 0)")
    assert "no progress from rank(s) 0" in v.headline and v.fence == []
    assert v.details == ["rank 0 (train leader, controller): alive, no progress for 5.0s; it was: [MainThread] "
                         "doing the loop"]


def test_a_rank_waiting_on_progress_is_progress_for_the_ranks_waiting_on_it(monkeypatch):
    """Rank 0 waits on the engine (rank 2) and makes no progress of its own; its beat still says it is not quiet
    while the engine progresses, so rank 1 waiting on rank 0 is renewed: progress is passed along waits."""
    w = dog(0)
    with waiting("events from engine 0", on=[2]) as a:
        monkeypatch.setattr(watchdog, "_last_progress", a.t0 - 100)
        for k in range(12):
            now = a.t0 + 0.5 * k
            assert tick(w, now, r1=(k, dict(quiet=0.1)), r2=(k, dict(quiet=0.2))) is None
            w.beat(now)
            assert json.loads(w.store.kv[KEY + "beat/0"])["quiet"] == pytest.approx(0.2)
        for k in range(12, 30):   # the engine stops progressing: so does rank 0, as the others see it
            now = a.t0 + 0.5 * k
            verdict = tick(w, now, r1=(k, dict(quiet=0.1)), r2=(k, dict(quiet=0.5 * (k - 11))))
            w.beat(now)
            if verdict is not None:
                break
    assert json.loads(w.store.kv[KEY + "beat/0"])["quiet"] >= D
    assert "no progress from rank(s) 2" in verdict.headline and "rank 2 (rollout, engine 0)" in verdict.details[0]


def test_a_work_wait_is_renewed_only_by_progress_in_that_work():
    """Rank 1 is in the same train step (phases: train) but stuck there, while another of its threads progresses:
    that does not renew the step's collectives. A rank not yet in the work renews it by any progress."""
    stuck = dict(quiet=0.1, phase_quiet={"train": 0.0}, phases=["train"])
    w = dog(0)
    with waiting("train step 3", on=[0, 1], phase=Phase.TRAIN, step=3) as a:
        verdict = None
        for k in range(14):
            stuck["phase_quiet"] = {"train": 0.5 * k}
            verdict = verdict or tick(w, a.t0 + 0.5 * k, r1=(k, dict(stuck)), r2=(k, {}))
    assert verdict is not None and "train step 3" in verdict.headline
    assert "rank 1 (train): alive, no progress for 5.0s" in verdict.details[0]
    w = dog(0)
    with waiting("publishing weights v3", on=[0, 2], phase=Phase.PUBLISH, step=3) as a:
        for k in range(30):   # the engine finishes its step before it joins: progress, not in the publication yet
            assert tick(w, a.t0 + 0.5 * k, r1=(k, {}), r2=(k, dict(quiet=0.2, phase_quiet={"publish": 9.0}))) is None


def test_a_silent_rank_is_called_frozen_or_dead_and_waits_on_it_defer_to_that():
    w = dog(0)
    with waiting("events from engine 0", on=[2]) as a:
        verdicts = []
        for k in range(16):
            now = a.t0 + 0.5 * k
            verdicts.append(tick(w, now, r1=(k, {}), r2=(min(k, 3), dict(quiet=0.0))))  # rank 2 stops at 1.5 s
    first = next(i for i, v in enumerate(verdicts) if v is not None)
    assert first == 13   # 5 s after its last beat was seen; never a "no progress" verdict before that
    v = verdicts[first]
    assert v.headline == "rank 2 (rollout, engine 0) sent no heartbeat for 5.0s: frozen or dead"
    assert v.details == ["its last heartbeat said: [MainThread] x"] and v.fence == [2]


def test_a_wait_on_ranks_that_only_wait_themselves_defers_two_beats():
    w = dog(1)
    with waiting("a work item from the leader (rank 0)", on=[0]) as a:
        times = [0.5 * k for k in range(16)
                 if tick(w, a.t0 + 0.5 * k, r0=(k, dict(quiet=0.5 * k, blocked=True))) is not None]
    assert times[0] == D + 2 * w.beat_s


def test_fencing_kills_only_a_process_that_is_still_that_rank_of_this_job():
    w = dog(0)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")}
    env.update({k: os.environ[k] for k in ("MASTER_PORT", "TORCHELASTIC_RESTART_COUNT") if k in os.environ})
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**env, "RANK": "2"})
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**env, "RANK": "5"})
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        host = os.uname().nodename
        w.info = {2: {"pid": frozen.pid, "host": host}, 1: {"pid": other.pid, "host": host},
                  0: {"pid": 1, "host": "elsewhere"}}
        assert w.fence(2).startswith(f"killed rank 2 (pid {frozen.pid} on this host)")
        assert frozen.wait(timeout=10) == -signal.SIGKILL
        assert w.fence(1) == f"pid {other.pid} is no longer rank 1 of this job: not killed"
        assert other.poll() is None
        assert w.fence(0) == "rank 0 runs on elsewhere: left to torchrun"
    finally:
        for p in (frozen, other):   # this test's own processes, by id
            if p.poll() is None:
                p.kill()
                p.wait()


def test_the_stall_report_names_the_rank_and_what_every_thread_was_doing(tmp_path, monkeypatch, capsys):
    def leave(code):
        raise SystemExit(code)
    monkeypatch.setattr(watchdog.os, "_exit", leave)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    w = dog(1, tmp_path)
    w.info = {0: {"pid": 1, "host": "elsewhere"}}
    with waiting("a work item from the leader (rank 0)", on=[0]):
        watchdog.progress("a note")
        with pytest.raises(SystemExit) as ex:
            w.fire(watchdog.Verdict("rank 0 (train leader, controller) sent no heartbeat for 5.0s: frozen or dead",
                                    ["its last heartbeat said: [MainThread] in train step 2 for 1.0s"], fence=[0]))
    assert ex.value.code == watchdog.STALL_EXIT_CODE
    report = (tmp_path / "stall-rank1.restart2.txt").read_text()
    head = report.split("\n\n")[0].splitlines()
    assert head[0] == "rank 1 (train) stopped the job: rank 0 (train leader, controller) sent no heartbeat for 5.0s: " \
                      "frozen or dead"
    assert head[2] == "rank 0 runs on elsewhere: left to torchrun"
    assert head[3].startswith("rank 1 was: [MainThread] waiting for a work item from the leader (rank 0) for ")
    assert head[3].endswith("(last progress: a note)")
    assert "Current thread" in report and "test_watchdog.py" in report      # every thread's stack follows
    assert capsys.readouterr().err.startswith("error: rank 1 (train) stopped the job: rank 0")


def test_a_role_that_fails_names_the_rank_whose_process_died(tmp_path, monkeypatch, capsys):
    """A SIGKILLed peer reaches the others as a broken connection: the failure report names it (here a zombie its
    parent has not reaped yet, as torchrun's children are for a moment), then the traceback."""
    def leave(code):
        raise SystemExit(code)
    monkeypatch.setattr(watchdog.os, "_exit", leave)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(dead.pid, signal.SIGKILL)
        host = os.uname().nodename
        w = dog(0, tmp_path)
        w.info = {1: {"pid": dead.pid, "host": host}, 2: {"pid": alive.pid, "host": host}}
        for _ in range(500):   # SIGKILL is delivered asynchronously: give a loaded machine a moment
            if w.process_gone(1):
                break
            time.sleep(0.01)
        assert w.process_gone(1) and not w.process_gone(2)
        with pytest.raises(SystemExit) as ex:
            w.fail("Traceback (most recent call last):\nRuntimeError: Connection closed by peer [127.0.0.1]:1234\n")
    finally:
        for p in (dead, alive):   # this test's own processes, by id
            if p.poll() is None:
                p.kill()
            p.wait()
    assert ex.value.code == 1
    head = (tmp_path / "failed-rank0.txt").read_text().split("\n\n")[0].splitlines()
    assert head[0] == f"rank 0 (train leader, controller) stopped the job: rank 1 (train) died: its process (pid " \
                      f"{dead.pid}) is gone"
    assert head[-2] == "RuntimeError: Connection closed by peer [127.0.0.1]:1234"
    assert capsys.readouterr().err.startswith("error: rank 0 (train leader, controller) stopped the job: rank 1 "
                                              "(train) died")


def test_a_peer_whose_death_shows_just_after_the_broken_connection_is_still_named(tmp_path, monkeypatch):
    """The broken connection can arrive before /proc shows the killed peer gone (seen on a fast host, where the fault
    matrix's killed follower was reported as an error of the leader's own): the failing rank looks again for
    PEER_EXIT_GRACE_S. Without a dead peer it names its own error, once the grace is over."""
    def leave(code):
        raise SystemExit(code)
    monkeypatch.setattr(watchdog.os, "_exit", leave)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killer = threading.Timer(0.2, peer.kill)
    try:
        w = dog(0, tmp_path)
        w.info = {1: {"pid": peer.pid, "host": os.uname().nodename}}
        assert not w.process_gone(1)
        killer.start()
        with pytest.raises(SystemExit):
            w.fail("Traceback (most recent call last):\nRuntimeError: Connection closed by peer [127.0.0.1]:1234\n")
        head = (tmp_path / "failed-rank0.txt").read_text().splitlines()[0]
        assert head == f"rank 0 (train leader, controller) stopped the job: rank 1 (train) died: its process (pid " \
                       f"{peer.pid}) is gone"
        peer.wait(timeout=10)
        w.info = {1: {"pid": os.getpid(), "host": os.uname().nodename}}   # a peer that stays alive
        t0 = time.monotonic()
        with pytest.raises(SystemExit):
            w.fail("Traceback (most recent call last):\nValueError: bad batch\n")
        assert time.monotonic() - t0 >= watchdog.PEER_EXIT_GRACE_S
        assert (tmp_path / "failed-rank0.txt").read_text().splitlines()[0] == \
            "rank 0 (train leader, controller) stopped the job: an error in this rank: ValueError: bad batch"
    finally:
        killer.cancel()
        if peer.poll() is None:   # this test's own process, by id
            peer.kill()
        peer.wait(timeout=10)


# -------------------------------------------------------------------------------------------------- fault plans
def test_fault_plans_parse_per_attempt_and_bad_entries_are_named():
    plans = parse("freeze 2 decode 1; kill 1 train 2 ;; slow 1 train 2 1.5 & hang 0 publish 3")
    assert plans == [[Fault(Kind.FREEZE, 2, Phase.DECODE, 1)], [Fault(Kind.KILL, 1, Phase.TRAIN, 2)], [],
                     [Fault(Kind.SLOW, 1, Phase.TRAIN, 2, 1.5), Fault(Kind.HANG, 0, Phase.PUBLISH, 3)]]
    for bad in ("freeze 2 decoding 1", "slow 1 train 2", "kill 1 train 2 3.0", "stop 1 train 2", "freeze x train 1"):
        with pytest.raises(ValueError, match=f"cannot read '{bad}'"):
            parse(bad)


def test_a_freeze_fires_once_on_the_first_rank_to_reach_its_phase_and_signals_the_target(monkeypatch):
    sent, slept = [], []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    store = FakeStore()
    plan = [Fault(Kind.FREEZE, 2, Phase.TRAIN, 2), Fault(Kind.SLOW, 1, Phase.TRAIN, 3, 0.25)]
    leader, follower = Injector(plan, 0, store), Injector(plan, 1, store)
    for inj in (leader, follower):
        inj.bind({0: {"pid": 100}, 1: {"pid": 101}, 2: {"pid": 102}})
    leader.at(Phase.TRAIN, 1)                 # too early
    follower.at(Phase.DECODE, 5)              # another phase
    assert sent == []
    follower.at(Phase.TRAIN, 2)               # first to reach train step 2: signals rank 2's process
    leader.at(Phase.TRAIN, 2)
    follower.at(Phase.TRAIN, 4)
    assert sent == [(102, signal.SIGSTOP)]
    leader.at(Phase.TRAIN, 3)                 # slow acts on its own rank only, at its step only
    follower.at(Phase.TRAIN, 3)
    follower.at(Phase.TRAIN, 3)
    follower.at(Phase.TRAIN, 4)
    assert slept == [0.25, 0.25]

"""Graceful preemption without torchrun (runtime/preempt.py): a signal becomes a request on this rank and in the
store (so every rank sees it), other signals are ignored, the grace period ends the process, and the leader's
after-event hook saves once at the first safe point and stops the controller. On real ranks:
tests/runtime/test_preempt_resume.py."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch.distributed as dist

import sched
from config import ConfigError, load_config
from runtime import preempt
from runtime.preempt import KEY, PREEMPTED_EXIT_CODE, Preempted, Preemption, Watcher
from runtime.rundir import periodic_checkpoints
from tests.runtime.test_crash_resume import Source
from tests.support.fake_backend import FakeBackend, RecordingController
from trainer import checkpoint


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def watcher(store, rank=1, signums=(signal.SIGTERM,), clock=None):
    r, w = os.pipe()
    os.set_blocking(r, False)
    exits: list[int] = []
    p = Preemption(10.0, clock=clock or time.monotonic)
    return Watcher(p, set(signums), rank, store, r, exit_fn=exits.append), w, exits


def test_the_first_request_wins_and_the_grace_period_runs_from_it():
    clock = Clock()
    p = Preemption(5.0, clock=clock)
    assert not p.requested and p.left_s() == float("inf") and not p.expired()
    assert p.request("SIGTERM on rank 2")
    clock.t += 3
    assert not p.request("SIGUSR1 on rank 0") and p.reason == "SIGTERM on rank 2"
    assert p.left_s() == pytest.approx(2.0) and not p.expired()
    clock.t += 2
    assert p.expired()


def test_a_signal_on_one_rank_reaches_the_others_through_the_store():
    store = dist.HashStore()
    w1, pipe1, _ = watcher(store, rank=1)
    w0, _, _ = watcher(store, rank=0)
    w0.step(0)
    assert not w0.p.requested                            # nothing yet
    os.write(pipe1, bytes([signal.SIGTERM]))
    w1.step(0)
    assert w1.p.reason == "SIGTERM on rank 1" and store.get(KEY).decode() == "SIGTERM on rank 1"
    w0.step(0)
    assert w0.p.reason == "SIGTERM on rank 1"           # the leader learns of it from the store


def test_stopping_the_watcher_waits_for_its_thread_to_leave_the_store():
    store = dist.HashStore()
    w, _, _ = watcher(store, rank=1)
    w.start()
    time.sleep(0.05)
    assert w.thread.is_alive()
    w.stop()            # a daemon thread left inside a store call at exit aborts the process (C++ terminate)
    assert not w.thread.is_alive()


def test_another_handled_signal_is_not_a_request():
    w, pipe, _ = watcher(dist.HashStore(), signums=(signal.SIGTERM,))
    os.write(pipe, bytes([signal.SIGINT]))               # Python's own SIGINT handler writes to the wakeup fd too
    w.step(0)
    assert not w.p.requested


def test_torchruns_sigterm_after_a_rank_died_still_ends_the_rank_at_once():
    store = dist.HashStore()
    w, pipe, exits = watcher(store)
    w.peers_gone = lambda: [2]                           # a rank on this host died: torchrun stops the others
    os.write(pipe, bytes([signal.SIGTERM]))
    w.step(0)
    assert exits == [128 + signal.SIGTERM] and not w.p.requested and not store.check([KEY])
    w2, pipe2, exits2 = watcher(store)                   # a preempted rank that already left is not a failure
    w2.peers_gone = lambda: [2]
    store.set(KEY, "SIGTERM on rank 0")
    os.write(pipe2, bytes([signal.SIGTERM]))
    w2.step(0)
    assert exits2 == [] and w2.p.reason == "SIGTERM on rank 0"


def test_the_grace_period_ends_the_process_with_the_preempted_code():
    clock = Clock()
    w, pipe, exits = watcher(None, clock=clock)
    os.write(pipe, bytes([signal.SIGTERM]))
    w.step(0)
    assert exits == []
    clock.t += 9.9
    w.step(0)
    assert exits == []
    clock.t += 0.2
    w.step(0)
    assert exits == [PREEMPTED_EXIT_CODE]


def test_install_turns_a_real_signal_into_a_request_and_keeps_catching_it_after():
    before = signal.getsignal(signal.SIGUSR1)
    store = dist.HashStore()
    preempt.install(["SIGUSR1"], 30.0, 3, store)
    preempt.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before   # no request: the previous handler is back
    p = preempt.install(["SIGUSR1"], 30.0, 3, store)
    try:
        assert p is not None and preempt.seen(store) == ""
        os.kill(os.getpid(), signal.SIGUSR1)               # the process survives: the handler catches it
        deadline = time.monotonic() + 5
        while not p.requested and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.reason == "SIGUSR1 on rank 3" and store.get(KEY).decode() == "SIGUSR1 on rank 3"
        assert preempt.seen(store) == ""                     # requested, not yet stopped: a run may still finish
        saves = []
        with pytest.raises(Preempted):
            preempt.safe_point_hook(p, lambda: True, lambda: saves.append(1))()
        assert saves == [1] and preempt.seen(store) == "SIGUSR1 on rank 3"   # stopped early: every rank exits 75
        preempt.uninstall()
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN   # requested: a second one in teardown is not fatal
        os.kill(os.getpid(), signal.SIGUSR1)
    finally:
        preempt.uninstall()
        signal.signal(signal.SIGUSR1, before)
        signal.set_wakeup_fd(-1)
    assert preempt.install([], 30.0, 0, store) is None   # no signals: nothing caught


@pytest.mark.parametrize("every", [0, 1])
@pytest.mark.parametrize("preset", ["sync", "rolloutpipe"])
def test_the_leader_saves_once_at_the_first_safe_point_and_stops(preset, every):
    cfg = load_config(None, [f"--checkpoint.every={every}", "--train.steps=6"])
    ctl = RecordingController(sched.load_preset(preset), Source(), group_size=3, prompts_per_step=4,
                              total_steps=6)
    saves: list[tuple[bool, int, int]] = []
    clock = Clock()
    p = Preemption(30.0, clock=clock)

    def save() -> None:
        t = ctl.v.trainer
        saves.append((t.busy, t.groups_since_step, t.steps_done))

    hook = periodic_checkpoints(cfg, ctl, save, p)

    def after(ev) -> None:
        if not p.requested and ctl.v.trainer.steps_done >= 2 and ctl.v.trainer.busy:   # mid train step
            p.request("SIGTERM on rank 2")
            saves.clear()                        # the periodic ones before the request
        hook(ev)

    with pytest.raises(Preempted, match="SIGTERM on rank 2"):
        ctl.run(FakeBackend(2, 0), after)
    assert len(saves) == 1, saves
    busy, accumulated, steps = saves[0]
    assert not busy and accumulated == 0 and 2 < steps < 6   # a safe point after that step, before the end


def test_a_preemption_signal_must_be_a_catchable_signal():
    assert load_config(None, ['--cluster.preempt_signals=["SIGTERM", "SIGUSR1"]']).cluster.preempt_signals == \
        ["SIGTERM", "SIGUSR1"]
    with pytest.raises(ConfigError, match="SIGKILL cannot be caught"):
        load_config(None, ['--cluster.preempt_signals=["SIGKILL"]'])
    with pytest.raises(ConfigError, match="'SIGTREM' is not a signal name \\(did you mean SIGTERM\\?\\)"):
        load_config(None, ['--cluster.preempt_signals=["SIGTREM"]'])


def test_a_save_replacing_the_same_step_leaves_a_resumable_checkpoint_at_every_moment(tmp_path):
    old = tmp_path / ".old_step_3"          # an exit between moving step_3 aside and renaming the new one in
    old.mkdir()
    (old / "COMPLETE").write_text(json.dumps({"step": 3, "files": {}}))
    assert checkpoint.latest(tmp_path) == old
    new = tmp_path / "step_3"
    new.mkdir()
    (new / "COMPLETE").write_text(json.dumps({"step": 3, "files": {}}))
    assert checkpoint.latest(tmp_path) == new


def test_a_role_that_fails_moments_before_its_deadline_waits_for_it_and_one_far_from_it_does_not():
    """The other ranks leave at their grace deadline (within about a poll of this one's) and cut this rank's
    collective: its error must end it at its own deadline with PREEMPTED_EXIT_CODE (the watcher), not as a failure.
    An error with the deadline far away (or no request) is reported at once."""
    now = [100.0]
    near = Preemption(grace_s=2.0, clock=lambda: now[0])
    near.request("SIGUSR1 on rank 2")
    now[0] += 2.0 - 0.1                       # 0.1 s left
    t0 = time.monotonic()
    preempt.await_deadline(near)
    assert time.monotonic() - t0 >= 0.1 + 2 * preempt.POLL_S - 0.02
    for p in (None, Preemption(grace_s=2.0), Preemption(grace_s=30.0)):
        if p is not None and p.grace_s > 10:
            p.request("SIGTERM on rank 0")    # requested, but 30 s left: a real error
        t0 = time.monotonic()
        preempt.await_deadline(p)
        assert time.monotonic() - t0 < 0.05

"""Crash and resume with nothing lost: the controller checkpointed mid-round (sched/resume.py). On real ranks, every
role SIGKILLed (or frozen) at every phase under `torchrun --max-restarts`: tests/runtime/test_fault_matrix.py."""
from __future__ import annotations

import io
from collections import Counter

import pytest
import torch

import sched
from rl.types import Trajectory
from sched.controller import PromptItem
from sched.decisions import Abort, TrainCall
from sched.events import Event, EventLog
from sched.views import RequestState
from tests.support.fake_backend import FakeBackend, RecordingController


class Source:
    """Prompts 0, 1, 2, ... with a resumable position (the runtime's PromptSource has one too)."""

    def __init__(self, start: int = 0):
        self.pos = start

    def __call__(self, n: int) -> list[PromptItem]:
        out = [PromptItem(i, [1, 2, 3 + i % 5] + [7] * (i % 3), str(i)) for i in range(self.pos, self.pos + n)]
        self.pos += n
        return out


class Crash(Exception):
    pass


def roundtrip(state: dict) -> dict:
    """Through torch.save / torch.load(weights_only=True), as a checkpoint's extra is."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def restarted_backend(engines: int, seed: int, version: int) -> FakeBackend:
    """Fresh engines (no weights); the trainer publishes its restored version first, as run_leader does."""
    b = FakeBackend(engines, seed)
    b.q.clear()
    b.trainer_version = version
    b.push(0.0, Event("version_published", 0, version=version))
    return b


def crash_and_resume(preset: str, at: int, steps: int = 4, engines: int = 2, seed: int = 1):
    """Run until the `at`-th event after which the controller may checkpoint with work in flight, checkpoint,
    crash; resume in a fresh controller on fresh engines and run to the end."""
    src = Source()
    ctl = RecordingController(sched.load_preset(preset), src, group_size=3, prompts_per_step=4, total_steps=steps)
    seen = [0]
    saved: dict = {}

    def after(ev: Event) -> None:
        t = ctl.v.trainer
        if not t.busy and t.groups_since_step == 0 and ctl.v.in_flight() > 0 and ctl.v.round >= 0:
            seen[0] += 1
            if seen[0] == at:
                saved.update(ctl=roundtrip(ctl.state_dict()), data=src.pos,
                             calls=len(backend.calls), ready=[g for g in ctl.v.groups.values() if g.scored])
                raise Crash

    backend = FakeBackend(engines, seed)
    with pytest.raises(Crash):
        ctl.run(backend, after)
    before = backend.calls[:saved["calls"]]
    log = EventLog()
    ctl2 = RecordingController(sched.load_preset(preset), Source(saved["data"]), group_size=3, prompts_per_step=4,
                               total_steps=steps, log=log)
    ctl2.load_state_dict(saved["ctl"])
    backend2 = restarted_backend(engines, seed + 100, ctl2.v.trainer.version)
    ctl2.run(backend2)
    assert ctl2.v.trainer.steps_done == steps
    return saved, before, backend2.calls, ctl2, log


@pytest.mark.parametrize("preset", ["sync", "rolloutpipe", "rollpacker", "streamrl"])
@pytest.mark.parametrize("at", [1, 3, 7])
def test_a_mid_round_checkpoint_loses_nothing_and_trains_nothing_twice(preset, at):
    saved, before, after, ctl2, log = crash_and_resume(preset, at)
    keys = Counter((t.group_id, t.sample_index) for call in before + after for g in call.groups
                   for t in g.trajectories)
    assert keys and max(keys.values()) == 1, [k for k, n in keys.items() if n > 1]
    trained_after = {(t.group_id, t.sample_index): t for call in after for g in call.groups for t in g.trajectories}
    # every scored-but-unconsumed trajectory in the checkpoint is trained after the restart, as it was: not
    # regenerated (the fake engines draw new lengths and rewards for anything generated again)
    carried = [(t.group_id, t.sample_index, t) for g in saved["ready"] if not g.consumed for t in g.trajectories]
    for gid, s, t in carried:
        got = trained_after.get((gid, s))
        if got is None:  # only a dropped sample (an abort policy's choice) may go untrained
            assert ctl2.v.dropped > 0
            continue
        assert (got.response_ids, got.reward, got.versions) == (t.response_ids, t.reward, t.versions)
    # every group started before the crash is closed by the end (trained whole, or void: every sample dropped by
    # a policy; a closed group of an older round is forgotten), none left hanging
    trained = {grp.group_id for call in before + after for grp in call.groups}
    for g in saved["ctl"]["views"]["groups"]:
        gid = g["group_id"]
        assert gid in trained or g["consumed"] or gid not in ctl2.v.groups or ctl2.v.groups[gid].closed, gid
    # nothing generated again before the engines held the checkpointed weights
    floor = saved["ctl"]["views"]["floor"]
    assert all(t.version >= floor for call in after for g in call.groups for t in g.trajectories
               if (g.group_id, t.sample_index) not in {(x, y) for x, y, _ in carried})


def _views_with(states: dict[int, str]):
    """A sync controller one round in, with request i put in states[i] (others left running)."""
    ctl = RecordingController(sched.load_preset("sync"), Source(), group_size=3, prompts_per_step=2, total_steps=3)
    backend = FakeBackend(1, 0)
    ctl.v.engines = []
    from sched.resources import EngineView
    ctl.v.engines = [EngineView(0)]
    ctl.apply(backend.next_event())                    # version 0 published
    ctl.decide(backend)                                # engine told to load
    ctl.apply(backend.next_event())                    # weights loaded
    ctl.decide(backend)                                # round 0 starts and is submitted
    g0 = ctl.v.groups[0]
    S = RequestState
    for rid, st in states.items():
        r = ctl.v.requests[rid]
        if st == "finished+scored":
            ctl.v.requests.set_state(r, S.FINISHED)
            g0.trajectories.append(Trajectory(0, r.sample_index, [1], [5, 6], [-0.5, -0.5], [0, 0], "stop", 1.0))
            g0.scored += 1
            ctl.v.groups.track(g0)
        elif st == "partial":
            ctl.v.requests.set_state(r, S.INTERRUPTING)
            r.partial = Trajectory(0, r.sample_index, [1], [9], [-0.1], [0], "interrupted",
                                   meta={"tag": torch.tensor([1, 2, 3], dtype=torch.uint8)})
        elif st == "aborting":
            ctl.command(backend, Abort(0, [rid]))   # RUNNING -> ABORTING, counted dropped
        else:
            ctl.v.requests.set_state(r, S(st))
    return ctl


def test_each_request_state_is_settled_on_restore():
    ctl = _views_with({0: "finished+scored", 1: "finished", 2: "aborting", 3: "partial", 4: "requeueing"})
    state = roundtrip(ctl.state_dict())
    fresh = RecordingController(sched.load_preset("sync"), Source(), group_size=3, prompts_per_step=2, total_steps=3)
    fresh.load_state_dict(state)
    got = {i: fresh.v.requests[i].state for i in range(6)}
    assert got == {0: "finished", 1: "restored", 2: "aborted", 3: "restored", 4: "restored", 5: "restored"}
    assert fresh.v.pending() == []                              # restored: held back until the engines have weights
    part = fresh.v.requests[3].partial
    assert part.response_ids == [9] and torch.equal(part.meta["tag"], torch.tensor([1, 2, 3],
                                                                                          dtype=torch.uint8))
    assert fresh.v.requests[3].tokens == 1 and fresh.v.requests[5].tokens == 0
    g0 = fresh.v.groups[0]
    assert [t.response_ids for t in g0.trajectories] == [[5, 6]] and g0.dropped == 1 and g0.scored == 1
    assert fresh.v.groups[0].prompt.prompt_ids == [1, 2, 3]
    aborted = [e for e in fresh.log.events if e.kind == "trajectory_aborted"]
    assert [e.req_id for e in aborted] == [2]                   # its one abort event (sched/lifecycle.py's rules)
    # weights arrive: the restored requests become pending, oldest first, and fifo submits them
    backend = restarted_backend(1, 5, fresh.v.trainer.version)
    fresh.v.engines = []
    from sched.resources import EngineView
    fresh.v.engines = [EngineView(0)]
    fresh.apply(backend.next_event())
    fresh.decide(backend)
    assert fresh.v.pending() == []                              # still restored: the engine is loading
    fresh.apply(backend.next_event())
    assert [r.req_id for r in fresh.v.pending()] == [1, 3, 4, 5]
    fresh.decide(backend)
    assert all(fresh.v.requests[i].state == "running" for i in (1, 3, 4, 5))


def test_a_restored_request_is_never_trained_twice_by_a_buggy_handoff():
    ctl = _views_with({0: "finished+scored", 1: "finished+scored", 2: "finished+scored"})
    ctl.train(FakeBackend(1, 0), TrainCall([0], True, True), [0])
    fresh = RecordingController(sched.load_preset("sync"), Source(), group_size=3, prompts_per_step=2, total_steps=3)
    fresh.load_state_dict(roundtrip(ctl.state_dict()))
    fresh.v.groups[0].consumed = False                          # a policy bug: hand group 0 over again
    fresh.v.groups.track(fresh.v.groups[0])
    with pytest.raises(sched.controller.InvariantError, match="trained twice"):
        fresh.train(FakeBackend(1, 0), TrainCall([0], True, True), [0])

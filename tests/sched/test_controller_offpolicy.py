"""The controller's partial-trajectory rules (Interrupt, Migrate, resume) and its staleness bound, driven through the
simulator backend so the events are the ones a real engine sends."""
from __future__ import annotations

import pytest

import sched
from rl.types import Trajectory
from sched.base import Rebalance
from sched.controller import Controller, InvariantError, PromptItem
from sched.decisions import Abort, Interrupt, Migrate, Submit
from sched.events import EventLog
from sched.resources import EngineView
from sched.views import Request, RequestState
from sim.backend import SimBackend
from sim.cost import CostModel, RewardLatency, RewardTask
from sim.tokens import RunList
from sim.workload import TraceWorkload

LONG, SHORT = 400, 30


def cost() -> CostModel:
    return CostModel(name="test", k1=1e-6, k2=1e-3, k3=1e-4, k4=1e-3, prefill_s_per_token=1e-5,
                     kv_capacity_tokens=16 * 1000, train_s_per_token=1e-5, publish_s=0.05, load_s=0.01,
                     reward=RewardLatency((RewardTask("math", 1.0, 1e-4, 0.1, 1.0),)), block_size=16, max_num_seqs=64)


def run(rebalance: Rebalance, steps: int = 2, engines: int = 2, preset: str = "sync"):
    w = TraceWorkload("t", tuple((16, (LONG, SHORT, SHORT, SHORT)) for _ in range(4)))
    backend = SimBackend(cost(), w, engines, 1, seed=0)
    counter = iter(range(10**6))
    source = lambda n: [PromptItem(i % 4, RunList.of(1, 16), None) for i in (next(counter) for _ in range(n))]
    p = sched.load_preset(preset)
    p.rebalance = rebalance
    log = EventLog()
    trained: list = []
    train = backend.train
    backend.train = lambda call, groups: (trained.extend(groups), train(call, groups))
    ctl = Controller(p, source, group_size=4, prompts_per_step=2, total_steps=steps, log=log)
    ctl.run(backend)
    return ctl, log.events, trained


def started(v) -> bool:
    """Some short sample has finished, so the long ones are well into decoding."""
    return any(q.state == "finished" for q in v.requests.values())


class Once(Rebalance):
    """Issues `make(v, r)` (a decision or a list of them) once, for the first long request that is running once
    the short ones have finished."""
    name = "once-test"

    def __init__(self, make):
        super().__init__()
        self.make, self.fired = make, False

    def plan(self, v):
        if self.fired:
            return []
        for r in v.requests.values():
            if r.state == "running" and r.sample_index == 0 and started(v):
                self.fired = True
                cmds = self.make(v, r)
                return cmds if isinstance(cmds, list) else [cmds]
        return []


def test_a_migrated_trajectory_finishes_on_its_destination_with_every_token_and_nothing_is_lost():
    ctl, events, trained = run(Once(lambda v, r: Migrate(r.engine, 1 - r.engine, [r.req_id])))
    inter = [e for e in events if e.kind == "trajectory_interrupted"]
    moved = [e for e in events if e.kind == "trajectory_migrated"]
    assert len(inter) == 1 and len(moved) == 1
    assert moved[0].req_id == inter[0].req_id and moved[0].data["dst"] == 1 - moved[0].data["src"]
    admitted = [e.engine for e in events if e.kind == "request_admitted" and e.req_id == inter[0].req_id]
    assert admitted == [moved[0].data["src"], moved[0].data["dst"]]
    traj = next(t for g in trained for t in g.trajectories if g.group_id == inter[0].group_id and t.sample_index == 0)
    assert len(traj.response_ids) == LONG and len(traj.versions) == LONG and 0 < inter[0].data["tokens"] < LONG
    keys = [(g.group_id, t.sample_index) for g in trained for t in g.trajectories]
    assert len(keys) == len(set(keys)) == 2 * 2 * 4 and ctl.life.fold.interrupted == 1


def test_an_interrupted_request_waits_pending_with_its_partial_and_is_admitted_again():
    ctl, events, trained = run(Once(lambda v, r: Interrupt(r.engine, [r.req_id])))
    rid = next(e.req_id for e in events if e.kind == "trajectory_interrupted")
    assert sum(1 for e in events if e.kind == "request_admitted" and e.req_id == rid) == 2
    assert not any(e.kind == "trajectory_migrated" for e in events)
    assert sum(len(g.trajectories) for g in trained) == 16


def test_dropping_a_request_whose_interrupt_is_in_flight_discards_it_once():
    ctl, events, trained = run(Once(lambda v, r: [Interrupt(r.engine, [r.req_id]), Abort(r.engine, [r.req_id])]))
    rid = next(e.req_id for e in events if e.kind == "trajectory_interrupted")
    assert [e.data for e in events if e.kind == "trajectory_aborted" and e.req_id == rid] == \
        [{"requeue": False, "interrupted": True}]
    assert sum(1 for e in events if e.kind == "request_admitted" and e.req_id == rid) == 1  # never resumed
    assert ctl.v.dropped == 1 and sum(len(g.trajectories) for g in trained) == 15


def test_a_trajectory_staler_than_the_declared_bound_is_caught():
    preset = sched.load_preset("rolloutpipe")  # CGP steps mid-round: later groups of a round are 1+ versions old
    preset.handoff.staleness_bound = lambda: 0
    w = TraceWorkload("t", tuple((16, (SHORT * (1 + i),) * 4) for i in range(8)))
    backend = SimBackend(cost(), w, 1, 1, seed=0)
    counter = iter(range(10**6))
    source = lambda n: [PromptItem(i % 8, RunList.of(1, 16), None) for i in (next(counter) for _ in range(n))]
    with pytest.raises(InvariantError, match="staleness above the bound 0"):
        Controller(preset, source, group_size=4, prompts_per_step=8, total_steps=4).run(backend)


def test_resuming_on_an_engine_older_than_the_tokens_so_far_is_caught():
    ctl = Controller(sched.load_preset("sync"), lambda n: [PromptItem(0, [1, 2], None)], 1, 1, 1)
    ctl.v.engines = [EngineView(0, version=1)]
    ctl.start_round(1)
    r = ctl.v.requests[0]
    r.partial = Trajectory(0, 0, [1, 2], [5, 6], [-1.0, -1.0], [1, 2], "interrupted")

    class Nothing:
        def submit(self, *a):
            raise AssertionError("must not reach the backend")

    with pytest.raises(InvariantError, match="older than its tokens so far"):
        ctl.submit(Nothing(), Submit(0, [0]))


def test_pending_index_follows_every_state_change_in_id_order():
    ctl = Controller(sched.load_preset("sync"), lambda n: [PromptItem(i, [1], None) for i in range(n)], 2, 3, 1)
    ctl.start_round(3)
    v = ctl.v
    assert [r.req_id for r in v.pending()] == list(range(6))
    S = RequestState
    v.requests.set_state(v.requests[1], S.RUNNING)
    v.requests.set_state(v.requests[4], S.RUNNING)
    assert [r.req_id for r in v.pending()] == [0, 2, 3, 5] and v.requests.count(S.RUNNING) == 2
    v.requests.set_state(v.requests[4], S.PENDING)        # requeued: back in id order, not at the end
    v.requests.set_state(v.requests[1], S.PENDING)
    assert [r.req_id for r in v.pending()] == list(range(6))
    del v.requests[0]
    assert [r.req_id for r in v.pending()] == list(range(1, 6))
    # every way of changing the mapping keeps the index: pop, setdefault, update, clear
    r5 = v.requests.pop(5)
    assert [r.req_id for r in v.pending()] == list(range(1, 5))
    v.requests.setdefault(5, r5)
    v.requests.update({9: Request(9, 4, 0, 4, 0, 1)})
    assert [r.req_id for r in v.pending()] == [1, 2, 3, 4, 5, 9]
    v.requests.check()
    v.requests[2].state = S.RUNNING                       # a change behind the table's back is caught by check()
    with pytest.raises(AssertionError, match="request 2 indexed as pending"):
        v.requests.check()
    v.requests.clear()
    assert v.pending() == [] and v.in_flight() == 0

"""A request waiting on a tool (`Request.tool_since`) stops waiting when its engine is gone: an engine failure's
take-back and a checkpoint's restore both return it without the call it waited on."""
from rl.types import Trajectory
from sched.controller import PromptItem
from sched.events import Event
from sched.fold import EventFold
from sched.partials import PartialPool
from sched.resources import EngineView
from sched.resume import _settle
from sched.views import GroupState, Request, RequestState, Views


def waiting_on_a_tool():
    v = Views(engines=[EngineView(0, version=0, assigned=1), EngineView(1, version=0)])
    g = GroupState(group_id=0, prompt_index=0, round=0, size=1, req_ids=[5])
    g.prompt = PromptItem(0, [1, 2, 3], None)
    v.groups[0] = g
    r = Request(req_id=5, group_id=0, sample_index=0, prompt_index=0, round=0, prompt_len=3)
    v.requests[5] = r
    v.requests.set_state(r, RequestState.RUNNING)
    r.engine = 0
    fold = EventFold(v, emit=lambda e: None)
    fold.partials = PartialPool()
    fold.partials.open(5, None)
    fold.apply(Event("tool_started", 1.0, engine=0, req_id=5, group_id=0, data={"turn": 1, "tool": "calculator"}))
    assert r.on_tool and r.tool_calls == 1
    return v, fold, r


def test_an_engine_failure_takes_back_a_request_waiting_on_a_tool_without_its_call():
    v, fold, r = waiting_on_a_tool()
    fold.apply(Event("engine_failed", 2.0, engine=0, data={"error": "boom", "held": {5: 0}, "permanent": False}))
    assert r.state == RequestState.PENDING and not r.on_tool


def test_a_restored_request_does_not_wait_on_the_tool_of_its_old_engine():
    v, fold, r = waiting_on_a_tool()
    r.partial = Trajectory(0, 0, [1, 2, 3], [7, 2, 9, 9], [-1.0, -1.0, 0.0, 0.0], [0] * 4, loss_mask=[1, 1, 0, 0])

    class Life:
        pass
    life = Life()
    life.v, life.emit = v, lambda e: None
    _settle(life, r)
    assert r.state == RequestState.RESTORED and not r.on_tool and r.partial.loss_mask == [1, 1, 0, 0]


def test_step_metrics_count_turns_and_tool_calls_of_multi_turn_episodes_only():
    from rl.types import Group
    from sched.metrics import rollout_stats

    def traj(meta):
        return Trajectory(0, 0, [1], [2, 3], [-1.0, -1.0], [0, 0], reward=1.0, meta=meta)
    multi = rollout_stats([Group(0, 0, None, [traj({"turns": 3, "tool_calls": 2, "tool_failures": 1}),
                                              traj({"turns": 1, "tool_calls": 0, "tool_failures": 0})])])
    assert (multi["turns_mean"], multi["tool_calls_mean"], multi["tool_failed_frac"]) == (2.0, 1.0, 0.5)
    single = rollout_stats([Group(0, 0, None, [traj({}), traj({})])])
    assert "turns_mean" not in single and "tool_calls_mean" not in single

"""verl's dynamic resource scheduling (Hybrid replicas on GPUs the trainer shares) as a simulator mechanism over the
elastic pool: its switches on hand-built snapshots, then whole runs on the simulator under random workloads."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sched
from rl.types import Trajectory
from sched.decisions import Interrupt, LendEngines, ReturnEngines
from sched.resources import EngineView
from sched.views import GroupState, Request, S, Views
from tests.support.offpolicy_sim import check_nothing_lost, sim_run

OVER = {"rebalance": {"name": "verl_hybrid", "hybrid": 1, "deactivate_ratio": 0.5}}


def views(elastic: bool = True) -> Views:
    """Three engines (engine 2 the Hybrid one); batch 2 groups of 2 samples (4 samples). Group 0 materialised (2
    samples); group 1 has a request running on engine 2 and one on engine 0."""
    v = Views(group_size=2, prompts_per_step=2, elastic=elastic)
    v.engines = [EngineView(i, version=0) for i in range(3)]
    g0 = GroupState(0, 0, 0, 2, req_ids=[0, 1], scored=2, materialized_seq=1)
    g0.trajectories = [Trajectory(0, i, [1], [2], [-1.0], [0], "stop") for i in range(2)]
    v.groups[0] = g0
    v.groups[1] = GroupState(1, 1, 0, 2, req_ids=[2, 3])
    for rid, (gid, state, eng) in enumerate([(0, "finished", -1), (0, "finished", -1), (1, "running", 2),
                                            (1, "running", 0)]):
        v.requests[rid] = Request(rid, gid, rid % 2, gid, 0, 4, state=state, engine=eng)
        if eng >= 0:
            v.engines[eng].assigned += 1
    return v


def test_verl_hybrid_switches_on_the_buffer_as_its_source_says():
    """ratio 0.5 of a 4-sample batch: 2 buffered samples deactivate the Hybrid engine (its running request
    interrupted first, the Standalone one untouched); at the next publication, with fewer than 4 buffered, it comes
    back; with a full batch buffered it stays with the trainer; on real ranks (not elastic) nothing happens."""
    p = sched.load_preset("pipelinerl", OVER)
    rb = p.rebalance
    assert sched.load_preset("pipelinerl", OVER).rebalance.plan(views(elastic=False)) == []
    v = views()
    assert rb.plan(v) == [Interrupt(2, [2]), LendEngines([2])] and not rb.active
    v.engines[2].lent = True
    assert rb.plan(v) == []                                     # no publication yet
    v.trainer.published = 1
    assert rb.plan(v) == [ReturnEngines([2])] and rb.active
    rb2 = sched.load_preset("pipelinerl", OVER).rebalance
    rb2.active, rb2.seen = False, 0
    full = views()
    full.groups[1].scored, full.groups[1].materialized_seq = 2, 2
    full.groups[1].trajectories = [Trajectory(1, i, [1], [2], [-1.0], [0], "stop") for i in range(2)]
    full.groups.track(full.groups[1])
    full.trainer.published = 1
    assert rb2.plan(full) == [] and not rb2.active               # a full batch buffered: no gap, no activation


def test_verl_hybrid_leaves_a_standalone_engine():
    v = views()
    rb = sched.load_preset("pipelinerl", {"rebalance": {"name": "verl_hybrid", "hybrid": 3}}).rebalance
    try:
        rb.plan(v)
    except ValueError as e:
        assert "sched.rebalance.hybrid = 3" in str(e)
    else:
        raise AssertionError("hybrid = every engine accepted")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), engines=st.integers(2, 4), prompts=st.integers(1, 4),
       ratio=st.sampled_from([0.1, 0.3, 1.0]))
def test_verl_hybrid_never_trains_while_its_hybrid_engines_roll_out(seed, engines, prompts, ratio):
    """On random simulated schedules: whenever the trainer trains, every Hybrid engine is lent to it; nothing runs
    on a lent engine; interrupted requests resume elsewhere with nothing lost; the preset's own bound holds."""
    H = engines - 1

    def check(ctl) -> None:
        v = ctl.v
        if v.trainer.busy:
            assert v.engines[H].lent, "a train call runs while the Hybrid engine rolls out"
        assert not any(v.engines[r.engine].lent for r in v.requests.in_state(S.RUNNING))

    ctl, events, w = sim_run("pipelinerl", seed, engines, 3, prompts, 6,
                             {"rebalance": {"name": "verl_hybrid", "hybrid": 1, "deactivate_ratio": ratio}},
                             check=check)
    assert ctl.v.trainer.steps_done == 6
    stats = ctl.preset.rebalance.stats()
    assert stats["deactivated"] >= 1 and stats["activated"] <= stats["deactivated"]
    assert all(len(groups) == prompts for _, _, groups in ctl.calls)
    check_nothing_lost(ctl, events, w)

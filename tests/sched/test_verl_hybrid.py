"""verl's dynamic resource scheduling (Hybrid replicas on GPUs the trainer shares) as a simulator mechanism over the
elastic pool: its switches on hand-built snapshots, then whole runs on the simulator under random workloads."""
from __future__ import annotations

import dataclasses
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sched
from rl.types import Trajectory
from sched.decisions import Interrupt, LendEngines, ReturnEngines
from sched.resources import EngineView
from sched.views import GroupState, Request, S, Views
from sim.backend import SimBackend
from sim.profiles import get_profile
from sim.run import simulate
from sim.workload import get_workload
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
    interrupted first, the Standalone one untouched); at the next publication it comes back only while fewer than
    0.5 x 4 samples are buffered (fixed_ratio's gap: generated - expected < ratio x required), so with those 2 still
    buffered it stays with the trainer, and with them trained it comes back; on real ranks nothing happens."""
    p = sched.load_preset("pipelinerl", OVER)
    rb = p.rebalance
    assert sched.load_preset("pipelinerl", OVER).rebalance.plan(views(elastic=False)) == []
    v = views()
    assert rb.plan(v) == [Interrupt(2, [2]), LendEngines([2])] and not rb.active
    v.engines[2].lent = True
    assert rb.plan(v) == []                                     # no publication yet
    v.trainer.published = 1
    assert rb.plan(v) == [] and not rb.active                   # 2 buffered = 0.5 x 4: no gap
    v.groups[0].consumed = True                                 # trained: nothing buffered
    v.groups.track(v.groups[0])
    v.trainer.published = 2
    assert rb.plan(v) == [ReturnEngines([2])] and rb.active


def test_verl_hybrid_default_policy_adapts_its_ratio_and_gates_activation_on_cost_and_benefit():
    """verl's `default` policy (default_policy.py) by hand on a 4-sample batch, ratio 0.5: the trainer comes free
    with 0 buffered at t = 0 and its batch is there at t = 8 (8 s for 4 samples waited on: 2 s a sample); at the
    publication the gap is 0.5 x 4 - 0 = 2 samples = 4 s < the 10 s switch cost: no activation (gated), and the
    ratio rises by clip(4 / 4, 0.02, 0.1) = 0.1. A cycle without waits lowers it by 0.02. Before any wait is
    measured the time per sample is 1000 s: any gap activates."""
    over = {"rebalance": {"name": "verl_hybrid", "hybrid": 1, "deactivate_ratio": 0.5, "policy": "default"}}
    rb = sched.load_preset("pipelinerl", over).rebalance
    rb.active, rb.seen = False, 0
    v = views()
    v.groups[0].consumed = True                                 # nothing buffered
    v.groups.track(v.groups[0])
    v.engines[2].lent = True
    v.now = 0.0
    assert rb.plan(v) == []                                     # the trainer is free, waiting
    for gid in (0, 1):                                          # 4 samples arrive: two fresh groups ready
        g = v.groups[gid]
        g.consumed, g.scored, g.materialized_seq = False, 2, 5 + gid
        g.trajectories = [Trajectory(gid, i, [1], [2], [-1.0], [0], "stop") for i in range(2)]
        v.groups.track(g)
    v.now = 8.0
    assert rb.plan(v) == [] and (rb.wait_s, rb.wait_samples) == (8.0, 4)
    for gid in (0, 1):                                          # trained, and the weights published
        v.groups[gid].consumed = True
        v.groups.track(v.groups[gid])
    v.trainer.published = 1
    assert rb.plan(v) == [] and not rb.active and rb.stats()["gated"] == 1.0
    assert rb.per_sample_s == 2.0 and rb.ratio == 0.6
    v.trainer.published = 2                                     # a cycle without waits: gap 0.6 x 4 = 2.4
    assert rb.plan(v) == [] and rb.ratio == 0.6 - 0.02          # samples x 2 s = 4.8 s < 10 s: still gated
    fresh = sched.load_preset("pipelinerl", over).rebalance     # no wait measured yet: 1000 s a sample
    fresh.active, fresh.seen = False, 0
    assert fresh.plan(v) == [ReturnEngines([2])] and fresh.active


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
       ratio=st.sampled_from([0.1, 0.3, 1.0]), policy=st.sampled_from(["fixed_ratio", "default"]))
def test_verl_hybrid_never_trains_while_its_hybrid_engines_roll_out(seed, engines, prompts, ratio, policy):
    """On random simulated schedules: whenever the trainer trains, every Hybrid engine is lent to it; nothing runs
    on a lent engine; interrupted requests resume elsewhere with nothing lost; the preset's own bound holds."""
    H = engines - 1

    def check(ctl) -> None:
        v = ctl.v
        if v.trainer.busy:
            assert v.engines[H].lent, "a train call runs while the Hybrid engine rolls out"
        assert not any(v.engines[r.engine].lent for r in v.requests.in_state(S.RUNNING))

    ctl, events, w = sim_run("pipelinerl", seed, engines, 3, prompts, 6,
                             {"rebalance": {"name": "verl_hybrid", "hybrid": 1, "deactivate_ratio": ratio,
                                            "policy": policy}},
                             check=check)
    assert ctl.v.trainer.steps_done == 6
    stats = ctl.preset.rebalance.stats()
    assert stats["deactivated"] >= 1 and stats["activated"] <= stats["deactivated"]
    assert all(len(groups) == prompts for _, _, groups in ctl.calls)
    check_nothing_lost(ctl, events, w)


def test_verl_hybrid_default_policy_weighs_the_backends_switch_time_against_the_gap():
    """With the backend reporting each switch's time (Views.switch_s), the gate's cost is an activation and a
    deactivation, 2 x switch_s, instead of verl's 10 s fallback: a 2-sample gap at 2 s a waited sample (4 s)
    activates at switch_s = 1.5 (3 s) and is gated at 2.5 (5 s), as at the fallback."""
    over = {"rebalance": {"name": "verl_hybrid", "hybrid": 1, "deactivate_ratio": 0.5, "policy": "default"}}
    for switch_s, back in ((0.0, False), (1.5, True), (2.5, False)):
        rb = sched.load_preset("pipelinerl", over).rebalance
        rb.active, rb.seen = False, 0
        rb.wait_s, rb.wait_samples = 8.0, 4                     # this cycle: 4 samples waited on for 8 s
        v = views()
        v.groups[0].consumed = True                             # nothing buffered: a gap of 0.5 x 4 samples
        v.groups.track(v.groups[0])
        v.engines[2].lent, v.trainer.published, v.switch_s = True, 1, switch_s
        assert (rb.plan(v) == [ReturnEngines([2])]) is back, switch_s


def _hybrid_run(switch_s: float):
    cost = dataclasses.replace(get_profile("cpu_tiny"), switch_s=switch_s)
    preset = sched.load_preset("pipelinerl", {"rebalance": {"name": "verl_hybrid", "hybrid": 1,
                                                            "deactivate_ratio": 0.3}})
    return simulate(preset, "cpu_tiny", cost, 3, 1, steps=6, group_size=4, prompts_per_step=4, seed=1)


def test_a_switch_delays_the_lent_gpus_joining_the_trainer_and_a_returned_engine_decoding():
    """cost.switch_s: a lent engine's GPUs join only the train calls that start that long after the lend, and an
    engine given back decodes again only that long after the return. At 0 the lent GPUs train; with a switch longer
    than the run they never join a call (nothing else changes: the same samples are trained)."""
    at_once = _hybrid_run(0.0)
    assert at_once.backend.lent_gpu_s > 0 and at_once.backend.switch_s == 0.0
    r = _hybrid_run(1e6)
    assert r.backend.lent_gpu_s == 0.0 and r.metrics["samples_trained"] == at_once.metrics["samples_trained"]
    cost = dataclasses.replace(get_profile("cpu_tiny"), switch_s=0.5)
    backend = SimBackend(cost, get_workload("cpu_tiny"), 2, 1)
    backend.command(LendEngines([1]))
    assert backend.lent_from == {1: 0.5} and backend.engines[1].hold_until == math.inf
    backend.command(ReturnEngines([1]))
    assert backend.engines[1].hold_until == 0.5 and not backend.lent      # awake only after the switch

"""APRIL (arXiv 2509.18521) and prime-rl's adaptive in-flight concurrency as presets: decisions on hand-built
snapshots with hand-computed outcomes, then whole runs on the simulator under random workloads and timings with each
design's defining property checked on what the trainer received."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sched
from rl.types import Trajectory
from sched.resources import EngineView
from sched.views import GroupState, Request, S, Views
from tests.support.offpolicy_sim import check_nothing_lost, sim_run


# ---- APRIL ------------------------------------------------------------------------------------------------------
def april_views(N: int, states: list[list[str]], version: int = 0) -> Views:
    """Groups 0.. of len(states[i]) samples, request ids consecutive; a sample "finished" is scored (a group of
    scored samples is materialised), "running" is on engine 0, "pending" waits. One engine at `version`."""
    v = Views(group_size=len(states[0]) if states else 1, prompts_per_step=N)
    v.trainer.version = v.trainer.published = version
    v.engines = [EngineView(0, version=version)]
    rid = 0
    for gid, samples in enumerate(states):
        g = GroupState(gid, gid, 0, len(samples))
        for i, s in enumerate(samples):
            r = Request(rid, gid, i, gid, 0, 4, state=s, engine=0 if s == "running" else -1, v_traj=version)
            v.requests[rid] = r
            g.req_ids.append(rid)
            if s == "finished":
                g.scored += 1
                g.trajectories.append(Trajectory(gid, i, [1], [2], [-1.0], [version], "stop"))
            v.engines[0].assigned += s == "running"
            rid += 1
        g.materialized_seq = gid if g.materialized else -1
        v.groups[gid] = g
    return v


def test_april_over_provisions_stops_at_n_and_carries_the_rest_hand_computed():
    """N = 2, N' = ceil(1.5 x 2) = 3. Fresh start: 3 prompts. Groups 0 and 1 complete while group 2 has one sample
    finished and one running: the batch is full, so the running one is interrupted and nothing more is placed.
    Once the two are trained (the step is closed) and the engine holds version 1, the next step pulls
    3 - 1 carried = 2 fresh prompts and places the carried request first."""
    p = sched.load_preset("april", {"dispatch": {"over_sampling": 1.5}})
    d, rb = p.dispatch, p.rebalance
    v = april_views(2, [], version=0)
    assert d.provision(2) == 3 and d.intake(v) == 3 and d.is_open(v)
    assert d.intake(v) == 0                                           # one step at a time
    v = april_views(2, [["finished"] * 2, ["finished"] * 2, ["finished", "running"]])
    d.until = 2
    assert d.admit(v) == []                                           # N complete: nothing more is placed
    cmds = rb.plan(v)
    assert [(c.engine, c.req_ids) for c in cmds] == [(0, [5])]       # only the running sample of group 2
    # the interrupt landed (request 5 pending with its tokens), groups 0 and 1 trained, the engine at version 1
    v = april_views(2, [["finished"] * 2, ["finished"] * 2, ["finished", "pending"]], version=1)
    for gid in (0, 1):
        v.groups[gid].consumed = True
        v.groups.track(v.groups[gid])
    v.trainer.groups_consumed = 2
    assert rb.plan(v) == []                                           # one group open, none ready: no stop
    assert d.intake(v) == 2 and d.until == 4                          # 3 - 1 carried
    subs = d.admit(v)
    assert [(s.engine, s.req_ids) for s in subs] == [(0, [5])]        # (the 2 fresh ones start with the round)
    stale = april_views(2, [["pending", "pending"]], version=1)
    stale.engines[0].version, stale.trainer.groups_consumed = 0, 0    # the engine has not adopted version 1 yet
    assert d.admit(stale) == []


def test_april_with_no_over_provisioning_is_synchronous():
    p = sched.load_preset("april", {"dispatch": {"over_sampling": 1.0}})
    assert p.dispatch.provision(4) == 4


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), engines=st.integers(1, 3), prompts=st.integers(1, 4),
       over=st.sampled_from([1.0, 1.5, 2.0, 3.0]))
def test_april_partials_carried_over_with_none_lost(seed, engines, prompts, over):
    """Every batch is exactly N groups; N' groups are open whenever a step opens; nothing runs while the trainer
    trains (a synchronous loop); nothing is dropped and every trained trajectory is whole; every interrupted
    request keeps the tokens it had (its trained trajectory begins with them, and the tokens after them come from
    a newer version), or, at the end of the run, still holds them as its pending partial."""
    opened: list[int] = []

    def check(ctl) -> None:
        v, d = ctl.v, ctl.preset.dispatch
        if v.trainer.busy:
            assert not v.requests.count(S.RUNNING), "a request runs while the trainer trains"
        if d.steps > len(opened):
            opened.append(len(v.open_groups()))

    ctl, events, w = sim_run("april", seed, engines, 3, prompts, 6, {"dispatch": {"over_sampling": over}},
                             check=check)
    assert ctl.v.trainer.steps_done == 6
    assert all(len(groups) == prompts for _, _, groups in ctl.calls)
    assert opened and all(n == ctl.preset.dispatch.provision(prompts) for n in opened)
    check_nothing_lost(ctl, events, w)
    trained = {(g.group_id, t.sample_index): t for _, _, gs in ctl.calls for g in gs for t in g.trajectories}
    for e in events:
        if e.kind != "trajectory_interrupted":
            continue
        t, n = trained.get((e.group_id, e.payload.sample_index)), e.data["tokens"]
        if t is not None:
            assert len(t.versions) >= n and max(t.versions[:n]) <= e.version
            assert len(t.versions) == n or t.versions[n] > e.version      # resumed on newer weights
        else:                                                              # its group not trained when the run ended
            r = ctl.v.requests[e.req_id]
            assert r.state != S.ABORTED
            assert (r.resumed_tokens if r.state == S.PENDING else r.tokens) >= n
    if over == 1.0:
        assert not any(e.kind == "trajectory_interrupted" for e in events)


def test_april_ends_a_step_before_its_slowest_group():
    """On one long-tailed schedule APRIL carries groups across steps (and so trains trajectories that mix
    versions), where sync with the same N waits for every group."""
    ctl, events, w = sim_run("april", 7, 2, 3, 4, 6)
    assert ctl.preset.dispatch.stats()["groups_carried"] > 0
    assert any(len(set(t.versions)) > 1 for _, _, gs in ctl.calls for g in gs for t in g.trajectories)
    check_nothing_lost(ctl, events, w)

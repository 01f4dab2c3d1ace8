"""The 2025-26 designs as presets: windowed FIFO (TitanRL / MiniMax Forge), pacing (tinker-cookbook) and PipelineRL.
Decisions on hand-built snapshots (the worked examples of their sources), then whole runs on the simulator under
random workloads and timings with each design's defining property checked on what the trainer received."""
from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sched
from rl.types import Trajectory
from sched.views import GroupState, Request, Views
from tests.support.offpolicy_sim import check_nothing_lost, sim_run


def snapshot(P: int, done: list[bool], consumed: int = 0) -> Views:
    """Groups 0.. of one sample each; `done[i]`: group i materialised; the first `consumed` were trained."""
    v = Views(group_size=1, prompts_per_step=P)
    for gid, ok in enumerate(done):
        g = GroupState(gid, gid, 0, 1, req_ids=[gid])
        v.requests[gid] = Request(gid, gid, 0, gid, 0, 4, state="finished" if ok else "running", v_traj=0)
        if ok:
            g.scored, g.materialized_seq = 1, gid
            g.trajectories = [Trajectory(gid, 0, [1], [2], [-1.0], [0], "stop")]
        g.consumed = gid < consumed
        v.groups[gid] = g
    return v


def handoff(window: int):
    return sched.load_preset("windowed_fifo", {"handoff": {"window": window}}).handoff


# ---- windowed FIFO ----------------------------------------------------------------------------------------------
def test_windowed_fifo_follows_the_worked_example_of_its_source():
    """windowed_fifo.md's example: P = 3, W = 3, groups 0, 1, 3, 4, 5 ready and group 2 slow. Strict FIFO takes 0
    and 1 and stalls; the window (anchored at 2 once 0 and 1 are taken) lets 3 complete the batch; 4 may overtake
    too, 5 may not."""
    done = [True, True, False, True, True, True]
    assert handoff(1).ready(snapshot(3, done)) is None                  # strict FIFO: stalls on group 2
    assert handoff(3).ready(snapshot(3, done)) == [0, 1, 3]
    assert handoff(3).ready(snapshot(3, done, consumed=4)) is None      # 4 alone in [2, 4]: 5 is outside
    v = snapshot(1, done, consumed=2)
    v.groups[3].consumed = True
    v.groups.track(v.groups[3])
    assert handoff(3).ready(v) == [4]                                   # the second and last overtake of group 2
    v.groups[4].consumed = True
    v.groups.track(v.groups[4])
    assert handoff(3).ready(v) is None                                  # W - 1 = 2 overtook it: 5 waits
    assert handoff(4).ready(v) == [5]


def test_windowed_fifo_bound_is_its_sources_formula():
    p = sched.load_preset("windowed_fifo", {"dispatch": {"lag": 2}, "handoff": {"window": 7}})
    assert p.handoff.tight_bound(3) == 2 + 2 and p.handoff.tight_bound(6) == 3 and p.handoff.tight_bound(1) == 8
    assert p.staleness_bound() == 8                                      # declared: the P = 1 bound


def overtakes(ctl) -> dict[int, int]:
    """Per trained group, how many younger groups were trained before it (in the order the hand-off took them)."""
    order = [g.group_id for _, _, groups in ctl.calls for g in groups]
    return {gid: sum(1 for other in order[:i] if other > gid) for i, gid in enumerate(order)}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), engines=st.integers(1, 3), window=st.integers(1, 6), lag=st.integers(0, 2),
       prompts=st.integers(1, 4))
def test_windowed_fifo_never_lets_more_than_w_minus_1_groups_overtake(seed, engines, window, lag, prompts):
    ctl, events, w = sim_run("windowed_fifo", seed, engines, 3, prompts, 6,
                             {"dispatch": {"lag": lag}, "handoff": {"window": window}})
    assert ctl.v.trainer.steps_done == 6
    over = overtakes(ctl)
    assert max(over.values()) <= window - 1
    if window == 1:
        order = [g.group_id for _, _, groups in ctl.calls for g in groups]
        assert order == sorted(order)                                   # strict FIFO
    bound = lag + math.ceil((window - 1) / prompts)
    for version, _, groups in ctl.calls:
        assert len(groups) == prompts
        for g in groups:
            assert all(version - min(t.versions) <= bound for t in g.trajectories)
    check_nothing_lost(ctl, events, w)


# ---- pacing -----------------------------------------------------------------------------------------------------
def pending_views(P: int, started: dict[int, int], pending: int, engine_version: int) -> Views:
    """Groups of one sample: `started` group -> the version it started on (running), then `pending` waiting ones;
    one engine at `engine_version`."""
    from sched.resources import EngineView
    v = Views(group_size=1, prompts_per_step=P)
    v.engines = [EngineView(0, version=engine_version, assigned=len(started))]
    gids = list(started) + [max(started, default=-1) + 1 + i for i in range(pending)]
    for gid in gids:
        run = gid in started
        v.requests[gid] = Request(gid, gid, 0, gid, 0, 4, state="running" if run else "pending",
                                  engine=0 if run else -1, v_traj=started.get(gid, -1))
        v.groups[gid] = GroupState(gid, gid, 0, 1, req_ids=[gid])
    return v


def test_pacing_pauses_admission_for_a_straggler_where_a_lag_cap_would_not():
    """P = 2, K = 1, D = 1; 4 groups started, one straggler of version 0 still running, engines at version 1.
    The lag cap (D) allows started < (1 + 1 + 1) x 2 = 6; the straggler's rule allows started <= (0 + 1 + 1) x 2 =
    4 (hand-computed): pacing admits nothing until the straggler is trained, then two (6 - 4)."""
    D = sched.REGISTRY["dispatch"]["pacing"]
    d = D(D.Params(max_steps_off_policy=1, pipeline_depth=1))
    d.admitted, d.live = 4, {3: 0}
    v = pending_views(2, {3: 0}, 3, engine_version=1)
    assert d.admit(v) == [] and d.paused == 1
    L = sched.REGISTRY["dispatch"]["lag_cap"]
    lag = L(L.Params(lag=1))
    lag.admitted = 4
    assert [len(s.req_ids) for s in lag.admit(v)] == [2]                # the lag cap alone would start two
    v.groups[3].consumed = True                                          # the straggler is trained
    v.groups.track(v.groups[3])
    subs = d.admit(v)
    assert [s.req_ids for s in subs] == [[4, 5]] and d.admitted == 6 and d.live == {4: 1, 5: 1}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), engines=st.integers(1, 3), K=st.integers(0, 3), depth=st.integers(-1, 3),
       prompts=st.integers(1, 4))
def test_pacing_never_drops_a_sample_and_keeps_staleness_at_most_k(seed, engines, K, depth, prompts):
    ctl, events, w = sim_run("pacing", seed, engines, 3, prompts, 6,
                             {"dispatch": {"max_steps_off_policy": K, "pipeline_depth": depth}})
    assert ctl.v.trainer.steps_done == 6
    for version, _, groups in ctl.calls:
        assert len(groups) == prompts
        for g in groups:
            assert all(0 <= version - min(t.versions) <= K for t in g.trajectories)
    check_nothing_lost(ctl, events, w)                                   # no abort, every trajectory whole
    assert not any(g.dropped for g in ctl.v.groups.values())


# ---- PipelineRL -------------------------------------------------------------------------------------------------
def pipelinerl_run(seed: int, engines: int, prompts: int, lag: int, too_old: str, weight_sync: str = "in_flight"):
    """sim_run's schedule (tests/support/offpolicy_sim.py), keeping the backend to read its re-prefill time."""
    import random

    from sched.controller import PromptItem
    from sched.events import EventLog
    from sim.backend import SimBackend
    from sim.tokens import RunList
    from tests.support.offpolicy_sim import Recorder, random_cost, random_workload
    rng = random.Random(seed)
    w = random_workload(rng, 64, 3)
    backend = SimBackend(random_cost(rng), w, engines, 1, seed=seed, counters_every_s=0.5)
    counter = iter(range(10**9))

    def source(n: int) -> list[PromptItem]:
        return [PromptItem(i % 64, RunList.of(1, w.prompt(i % 64).prompt_len), None)
                for i in (next(counter) for _ in range(n))]

    log = EventLog()
    preset = sched.load_preset("pipelinerl", {"dispatch": {"lag": lag}, "handoff": {"too_old": too_old},
                                              "weight_sync": {"name": weight_sync}})
    ctl = Recorder(preset, source, group_size=3, prompts_per_step=prompts, total_steps=6, log=log)
    ctl.run(backend)
    return ctl, log.events, w, backend


def started(events) -> list[tuple[int, int]]:
    """(group, engine version) in the order groups started (their first admission)."""
    seen: dict[int, int] = {}
    for e in events:
        if e.kind == "request_admitted" and e.group_id not in seen:
            seen[e.group_id] = e.version
    return list(seen.items())


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), engines=st.integers(1, 3), lag=st.integers(0, 3), prompts=st.integers(1, 4))
def test_pipelinerl_live_requests_continue_on_new_weights_with_their_kv_within_max_lag(seed, engines, lag, prompts):
    """The in-flight update keeps the KV (no re-prefill; some trajectory decodes under two versions, in order); the
    actors' max_lag back-pressure holds for every group; with `too_old = "count"` (PipelineRL's trainer) the
    samples trained more than max_lag versions late are exactly the ones counted, and nothing is dropped."""
    ctl, events, w, backend = pipelinerl_run(seed, engines, prompts, lag, "count")
    assert ctl.v.trainer.steps_done == 6
    assert backend.reprefill_s == 0
    for i, (_, u) in enumerate(started(events)):
        assert i < (lag + u + 1) * prompts                                  # the max_lag admission cap
    late = 0
    for version, _, groups in ctl.calls:
        assert len(groups) == prompts
        for g in groups:
            for t in g.trajectories:
                assert list(t.versions) == sorted(t.versions)
                late += version - min(t.versions) > lag
    assert ctl.preset.handoff.stats() == {"too_old_trained": late, "too_old_dropped": 0}
    check_nothing_lost(ctl, events, w)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), engines=st.integers(1, 3), lag=st.integers(0, 2), prompts=st.integers(1, 4))
def test_pipelinerl_dropping_too_old_samples_trains_none_staler_than_max_lag(seed, engines, lag, prompts):
    ctl, events, _, _ = pipelinerl_run(seed, engines, prompts, lag, "drop")
    assert ctl.preset.staleness_bound() == lag                              # and the controller checks it
    for version, _, groups in ctl.calls:
        for g in groups:
            assert all(version - min(t.versions) <= lag for t in g.trajectories)
    dropped = sum(1 for e in events if e.kind == "trajectory_aborted")
    assert ctl.preset.handoff.stats()["too_old_dropped"] == dropped


def test_pipelinerl_keeps_the_kv_where_an_areal_load_recomputes_it():
    """One schedule, two weight syncs: `in_flight` re-prefills nothing; `areal` (AReaL's interrupt) re-prefills the
    running sequences at every load; both continue trajectories across versions."""
    mixed = {}
    for ws in ("in_flight", "areal"):
        ctl, _, _, backend = pipelinerl_run(3, 2, 3, 2, "count", ws)
        mixed[ws] = sum(1 for _, _, gs in ctl.calls for g in gs for t in g.trajectories if len(set(t.versions)) > 1)
        assert (backend.reprefill_s == 0) == (ws == "in_flight")
    assert mixed["in_flight"] > 0 and mixed["areal"] > 0

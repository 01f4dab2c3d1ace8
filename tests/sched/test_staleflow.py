"""StaleFlow's mechanisms (routing Alg. 2-3 with the Eq. 2-4 cost model, sync Alg. 4, migration Alg. 5, Consume)
and the strict-staleness (AReaL-style) baseline: decisions on hand-built snapshots, then whole runs on the
simulator under random response lengths with the staleness bound checked on what the trainer received."""
from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sched
from rl.types import Trajectory
from sched.controller import Controller, PromptItem
from sched.events import EventLog
from sched.policies.staleflow.buffers import StalenessBuffers
from sched.policies.staleflow.cost import InstanceSnap, ThroughputModel
from sched.policies.staleflow.algorithm1 import StaleFlow, algorithm1, discard
from sched.policies.staleflow.migration import StaleFlowMigration
from sched.policies.staleflow.routing import fewest_routes, marginal_routes
from sched.policies.staleflow.state import StaleFlowParams, StaleFlowState
from sched.policies.staleflow.store import Item, TSQueue
from sched.resources import EngineView
from sched.views import ON_ENGINE, GroupState, Request, RequestState, Views
from sim.backend import SimBackend
from sim.cost import CostModel as SimCost
from sim.cost import RewardLatency, RewardTask
from sim.tokens import RunList
from sim.workload import TraceWorkload


def item(rid: int, gid: int, prompt_len: int = 100, v_traj: int = -1, versions: list[int] | None = None,
         prio: float | None = None) -> Item:
    r = Request(rid, gid, 0, gid, 0, prompt_len, v_traj=v_traj)
    if versions:
        r.partial = Trajectory(gid, 0, [1] * prompt_len, [5] * len(versions), [-1.0] * len(versions), versions,
                               "interrupted")
    need = max(versions) if versions else max(v_traj, 0)
    return Item(r, prio if prio is not None else (v_traj if v_traj >= 0 else float("inf")),
                prompt_len + len(versions or []), need)


# ---- cost model (Eq. 2-4) --------------------------------------------------------------------------------------
@pytest.mark.parametrize("length,expected", [(100, 78), (200, 74), (500, 64), (1000, 53), (2000, 39)])
def test_mu_threshold_admits_the_extractions_count_on_an_empty_instance(length, expected):
    """Table 4 with mu = 0.3 on one empty instance: how many trajectories of each length are routed before the
    marginal gain falls below 0.3 x the ideal gain (counts worked out by hand from Eq. 2-4)."""
    sb = StalenessBuffers(eta=0, batch=1000)
    snaps = {0: InstanceSnap(0, 0, 0)}
    routes = marginal_routes(snaps, [item(i, i, length) for i in range(500)], sb, ThroughputModel(), 0.3)
    assert len(routes) == expected
    assert sb.live() == expected                        # each routed group reserved


def test_marginal_gain_is_zero_when_the_trajectory_would_queue():
    cm = ThroughputModel()
    s = InstanceSnap(0, 0, running=10, kv=900.0, budget=1000.0)
    assert cm.marginal_gain(s, 50) > 0 and cm.marginal_gain(s, 200) == 0.0
    assert cm.marginal_gain(InstanceSnap(0, 0, 10, waiting=1), 1) == 0.0
    assert cm.ideal_gain(100) == pytest.approx(1 / (7.28e-8 * 100 + 1.72e-3 + 1.07e-2))


snap_st = st.builds(InstanceSnap, engine=st.integers(0, 7), version=st.just(0), running=st.integers(0, 300),
                    waiting=st.sampled_from([0, 0, 0, 2]), kv=st.floats(0, 2e6), budget=st.sampled_from([1e6, 3e6]))


@settings(max_examples=200, deadline=None)
@given(st.lists(snap_st, min_size=1, max_size=12), st.integers(1, 40_000))
def test_best_gain_is_the_max_of_marginal_gain_with_the_lowest_engine_among_equals(snaps, length):
    """Routing's inlined arithmetic (cost.py best_gain) picks what max over marginal_gain picks, bit for bit."""
    cm = ThroughputModel()
    gain, best = cm.best_gain(snaps, length)
    want = max((cm.marginal_gain(s, length), -s.engine) for s in snaps)
    assert (gain, -best.engine) == want and cm.marginal_gain(best, length) == gain


# ---- routing (Alg. 2-3) ----------------------------------------------------------------------------------------
def test_routing_serves_the_stalest_first_on_the_oldest_instance_that_gains_enough():
    sb = StalenessBuffers(eta=1, batch=8, v_next=1)
    sb.reserve(50, 0)                                   # group 50: reserved at version 0 (buffer 1)
    snaps = {0: InstanceSnap(0, 1, 0), 1: InstanceSnap(1, 0, 0), 2: InstanceSnap(2, 1, 0, loading=True)}
    items = [item(3, 60), item(1, 51, v_traj=0, versions=[0, 1]), item(0, 52, v_traj=0, versions=[0]),
             item(2, 50, prio=0)]
    items.sort(key=lambda it: (it.prio, it.req.req_id))
    routes = marginal_routes(snaps, items, sb, ThroughputModel(), 0.3)
    got = {it.req.req_id: eng for eng, it in routes}
    assert [it.req.req_id for _, it in routes] == [0, 1, 2, 3]   # MLQ: V_traj 0 queue, then new groups
    assert got[0] == 1            # waterfall: the version-0 instance first
    assert got[1] == 0            # its newest token is version 1: only the version-1 instance
    assert got[2] == 1            # a member of reserved group 50 at version 0 (0 + 1 >= its buffer 1)
    assert got[3] in (0, 1) and 2 not in got.values()   # never to an instance mid-Pull
    assert sb.entry(60) is not None and sb.entry(50).v == 0


def test_routing_withholds_when_no_instance_gains_enough_and_blocks_what_follows():
    sb = StalenessBuffers(eta=2, batch=64)
    busy = {0: InstanceSnap(0, 0, running=200, kv=2e6)}
    assert marginal_routes(busy, [item(i, i) for i in range(3)], sb, ThroughputModel(), 0.3) == []
    assert sb.live() == 0
    # vanilla routing ignores gains: fewest trajectories, until the staleness manager says no
    snaps = {0: InstanceSnap(0, 0, running=5), 1: InstanceSnap(1, 0, running=1)}
    sb = StalenessBuffers(eta=0, batch=3)
    routes = fewest_routes(snaps, [item(i, i) for i in range(5)], sb)
    assert [e for e, _ in routes] == [1, 1, 1] and sb.live() == 3     # 3 slots for version 0 with eta 0
    # a Route to an instance mid-Pull waits for it: the store does not pile onto the first instance that pulled
    snaps = {0: InstanceSnap(0, 1, running=0), 1: InstanceSnap(1, 0, running=0, loading=True),
             2: InstanceSnap(2, 0, running=0, loading=True)}
    routes = fewest_routes(snaps, [item(i, i) for i in range(5)], StalenessBuffers(eta=1, batch=8, v_next=1))
    assert [e for e, _ in routes] == [0]          # one, then its load exceeds the pulling instances' (0)


# ---- snapshots (Eq. 1) -----------------------------------------------------------------------------------------
def test_an_engine_report_is_used_only_when_it_agrees_with_the_issued_commands():
    v = Views(group_size=1, prompts_per_step=2)
    v.engines = [EngineView(0, version=0, running=2, kv_used=100, kv_free=900, assigned=2),
                 EngineView(1, version=0, running=1, kv_used=50, kv_free=950, assigned=2)]
    for rid, eng in ((0, 0), (1, 0), (2, 1), (3, 1)):
        v.requests[rid] = Request(rid, rid, 0, rid, 0, 10, state="running", engine=eng, tokens=5)
    st_ = StaleFlowState(StaleFlowParams(eta=1, block_size=16))
    st_.routed = {0, 1, 2, 3}
    snaps = st_.snapshots(v, budget=float("inf"))
    assert snaps[0].kv == 1600.0 and snaps[0].budget == 16000.0          # valid: the engine's own numbers
    assert snaps[1].running == 2 and snaps[1].kv == 30.0                 # stale report: P's estimate
    assert (st_.snaps_accepted, st_.snaps_estimated, st_.snaps_empty_pull) == (1, 1, 0)
    v.requests.set_state(v.requests[3], RequestState.FINISHED)
    assert st_.snapshots(v, float("inf"))[1].requests == (2,) and 3 not in st_.routed
    # an empty instance mid-Pull: exact without a report, counted apart; one holding requests while it loads is not
    v.engines.append(EngineView(2, version=0, loading=True))
    st_ = StaleFlowState(StaleFlowParams(eta=1, block_size=16))
    st_.routed = {0, 1, 2}
    snaps = st_.snapshots(v, float("inf"))
    assert snaps[2].loading and snaps[2].kv == 0.0 and snaps[2].requests == ()
    assert (st_.snaps_accepted, st_.snaps_estimated, st_.snaps_empty_pull) == (1, 1, 1)
    v.engines[0].loading = True
    st_.snapshots(v, float("inf"))
    assert (st_.snaps_accepted, st_.snaps_estimated, st_.snaps_empty_pull) == (1, 3, 2)


# ---- migration (Alg. 5) ----------------------------------------------------------------------------------------
def test_migration_trims_long_wait_queues_and_drains_the_fastest_instance_on_imbalance():
    v = Views(group_size=1, prompts_per_step=4)
    v.engines = [EngineView(0, version=0, running=6, waiting=0, kv_used=10, kv_free=10**6, assigned=6),
                 EngineView(1, version=0, running=1, waiting=0, kv_used=10, kv_free=10**6, assigned=1),
                 EngineView(2, version=0, running=1, waiting=5, kv_used=10, kv_free=10**6, assigned=6),
                 EngineView(3, version=0)]                               # idle: left out of the ratio
    rid = 0
    for eng, n in ((0, 6), (1, 1), (2, 6)):
        for _ in range(n):
            v.requests[rid] = Request(rid, rid, 0, rid, 0, 10, state="running", engine=eng)
            rid += 1
    routing = StaleFlow(StaleFlow.Params(eta=1, period_s=0))
    routing.state.routed = set(range(rid))
    m = StaleFlowMigration()
    m.bind(SimpleNamespace(dispatch=routing))
    out = dict(m.select(routing.state.snapshots(v, float("inf")), routing.state.model))
    assert out[2] == [11, 12]                         # 5 waiting > phi_wait 3: the 2 latest
    assert out[0] == [0, 1, 2, 3, 4, 5]               # T(6) / T(1) > 5: everything on the fastest
    assert 1 not in out and 3 not in out


# ---- Algorithm 1: one pass, sync -> migrate -> route -------------------------------------------------------------
def one_engine_views(pending: int, engines: list[EngineView], published: int) -> Views:
    v = Views(group_size=1, prompts_per_step=4)
    v.engines = engines
    v.trainer.published = v.trainer.version = published
    for rid in range(pending):
        v.requests[rid] = Request(rid, rid, 0, rid, 0, 100)
    return v


def test_algorithm_1_syncs_then_migrates_then_routes_on_one_snapshot():
    """Engine 0 lags (version 0, published 1) with one trajectory on it; the buffers (eta 0, v_next 1) admit new
    groups only at version 1, so no TS trajectory is routable to it at its version: Alg. 4 selects it. Routing in
    the same pass must see it mid-Pull and empty: nothing is routed onto it, and the Interrupt names only what ran
    there before the pass (never a trajectory routed a moment earlier, the order the paper rules out)."""
    engines = [EngineView(0, version=0, running=1, kv_used=1, kv_free=10**6, assigned=1),
               EngineView(1, version=1, running=0, kv_used=0, kv_free=10**6)]
    v = one_engine_views(3, engines, published=1)
    v.requests[10] = Request(10, 10, 0, 10, 0, 100, state="running", engine=0, v_traj=0)
    preset = sched.load_preset("staleflow", {"dispatch": {"eta": 0, "period_s": 0.0}})
    preset.dispatch.state.routed = {10}
    preset.dispatch.state._buffers = StalenessBuffers(eta=0, batch=4, v_next=1)
    assert preset.design is preset.dispatch           # the routing dispatch decides the three kinds together
    joint = preset.design.decide(v)
    subs = joint.submit
    assert [s.engine for s in subs] == [1] and sorted(subs[0].req_ids) == [0, 1, 2]
    cmds = joint.weight_sync
    assert [(type(c).__name__, c.engine) for c in cmds] == [("Interrupt", 0), ("LoadWeights", 0)]
    assert cmds[0].req_ids == [10] and cmds[1].version == 1
    assert joint.rebalance == []                      # nothing waits or runs unevenly enough to migrate


def test_discard_takes_interrupted_trajectories_off_waiting_first_and_the_kv_in_proportion():
    snaps = {0: InstanceSnap(0, 0, running=4, waiting=2, kv=400.0, requests=(1, 2, 3, 4, 5, 6)),
             1: InstanceSnap(1, 0, running=2, kv=200.0, requests=(7, 8))}
    out = {0: discard(snaps[0], [5, 6, 4]), 1: discard(snaps[1], [7, 8])}
    assert (out[0].running, out[0].waiting, out[0].kv, out[0].requests) == (3, 0, 300.0, (1, 2, 3))
    assert (out[1].running, out[1].kv, out[1].requests) == (0, 0.0, ())
    assert snaps[0].running == 4 and discard(snaps[0], []) is snaps[0]     # the input is not changed


# ---- Algorithm 4, vanilla sync, the TS summary and intake -------------------------------------------------------
def sync_case(ts_version: int | None) -> tuple[Views, Any]:
    """Two lagging engines at version 0 (published 2, eta 1, v_next 2): engine 0 idle, engine 1 busy. TS: fresh
    groups, or (ts_version) one partial trajectory whose newest token is that version."""
    engines = [EngineView(0, version=0, kv_free=10**6), EngineView(1, version=0, running=1, kv_used=1,
                                                                   kv_free=10**6, assigned=1)]
    v = one_engine_views(0 if ts_version is not None else 2, engines, published=2)
    v.requests[9] = Request(9, 9, 0, 9, 0, 100, state="running", engine=1, v_traj=0)
    if ts_version is not None:
        r = v.requests[5] = Request(5, 5, 0, 5, 0, 100, v_traj=ts_version)
        r.partial = Trajectory(5, 0, [1] * 100, [5], [-1.0], [ts_version], "interrupted")
    preset = sched.load_preset("staleflow", {"dispatch": {"eta": 1, "period_s": 0.0}})
    preset.dispatch.state.routed = {9}
    preset.dispatch.state._buffers = StalenessBuffers(eta=1, batch=4, v_next=2)
    return v, preset


def selected(v: Views, p: Any) -> list[int]:
    """The instances Algorithm 4 selects on a fresh snapshot."""
    st_ = p.dispatch.state
    b = st_.buffers(v)
    return p.weight_sync.select(st_.snapshots(v, float("inf")), TSQueue(v, b, st_.aborts.dropping), b,
                                v.trainer.published, p.dispatch.route)


def test_algorithm_4_syncs_only_lagging_instances_nothing_routable_can_use_and_a_tentative_plan_would_fill():
    v, p = sync_case(None)                     # fresh groups: version 0 + eta 1 < v_next 2, so none is routable
    st_ = p.dispatch.state
    _, pulls, _ = algorithm1(v, st_, st_.snapshots(v, float("inf")), p.dispatch.route, p.weight_sync, None)
    got = [(type(c).__name__, c.engine) for c in pulls]
    assert got == [("LoadWeights", 0), ("Interrupt", 1), ("LoadWeights", 1)]      # the busy one interrupted first
    v, p = sync_case(0)                        # a partial trajectory of version 0: routable at version 0
    assert selected(v, p) == []                # still useful as it is
    v, p = sync_case(2)                        # needs version 2: eligible; each instance's own tentative plan
    assert selected(v, p) == [0, 1]            # places it
    v, p = sync_case(None)
    p.dispatch.state._buffers = StalenessBuffers(eta=1, batch=1, v_next=2)
    p.dispatch.state._buffers.reserve(77, 2)   # both version-2 slots (buffers 3 and 2) taken: a sync would not
    p.dispatch.state._buffers.reserve(78, 2)   # be used
    assert selected(v, p) == []


def test_vanilla_sync_pulls_every_lagging_instance_at_once_interrupting_what_runs():
    v, _ = sync_case(None)
    p = sched.load_preset("staleflow_vanilla", {"dispatch": {"eta": 1, "period_s": 1e9}})
    p.dispatch.state.routed = {9}
    p.dispatch.state.last_pass = v.now = 0.0     # mid-period: event-driven, not part of a pass
    cmds = p.design.decide(v).weight_sync
    assert [(type(c).__name__, c.engine) for c in cmds] == [("LoadWeights", 0), ("Interrupt", 1),
                                                            ("LoadWeights", 1)]
    assert cmds[1].req_ids == [9] and all(c.version == 2 for c in cmds if type(c).__name__ == "LoadWeights")


@given(prios=st.lists(st.tuples(st.sampled_from(["fresh", "reserved", "partial"]), st.integers(0, 4)), max_size=8),
       v_next=st.integers(0, 3), eta=st.integers(0, 2), u=st.integers(-1, 6), loading=st.booleans())
@settings(max_examples=150, deadline=None)
def test_ts_summary_answers_what_trying_every_trajectory_answers(prios, v_next, eta, u, loading):
    sb = StalenessBuffers(eta=eta, batch=2, v_next=v_next)
    items = []
    for i, (kind, ver) in enumerate(prios):
        if kind == "partial":
            items.append(item(i, 100 + i, v_traj=min(ver, 3), versions=[ver]))
        else:
            if kind == "reserved" and sb.can_assign(ver):
                sb.reserve(100 + i, ver)
            items.append(item(i, 100 + i))
    snap = InstanceSnap(0, u, 0, loading=loading)
    from sched.policies.staleflow.store import TSSummary, routable
    assert TSSummary(sb, items).any_routable(snap) == any(routable(sb, it, snap) for it in items)


def test_ts_intake_keeps_eta_plus_one_batches_of_unreserved_groups_waiting():
    from sched.policies.staleflow.store import ts_intake
    v = Views(group_size=2, prompts_per_step=2)
    sb = StalenessBuffers(eta=1, batch=2)
    assert ts_intake(v, sb, 0) == 2                       # empty: pull a round
    for rid in range(6):                                  # 3 groups of 2 waiting, unreserved
        v.requests[rid] = Request(rid, rid // 2, rid % 2, rid // 2, 0, 10)
    assert ts_intake(v, sb, 0) == 0                       # 3 + 2 > (1 + 1) x 2
    sb.reserve(0, 0)                                      # group 0 reserved: no longer counted
    assert ts_intake(v, sb, 0) == 2 and ts_intake(v, sb, 3) == 0    # 2 + 2 <= 4; an explicit capacity of 3
    for rid in (2, 3):                                    # group 1 started (admitted once, back pending): not
        r = v.requests[rid]                               # waiting fresh
        r.v_traj = 0
        v.requests.set_state(r, RequestState.RUNNING)
        v.requests.set_state(r, RequestState.PENDING)
    assert ts_intake(v, sb, 3) == 2


# ---- whole runs on the simulator --------------------------------------------------------------------------------
def sim_cost() -> SimCost:
    return SimCost(name="test", k1=1e-6, k2=1e-3, k3=1e-4, k4=1e-3, prefill_s_per_token=1e-5,
                   kv_capacity_tokens=16 * 200, train_s_per_token=1e-5, publish_s=0.05, load_s=0.01,
                   reward=RewardLatency((RewardTask("math", 1.0, 1e-3, 0.5, 1.0),)), block_size=16, max_num_seqs=64)


def run(preset: str, eta: int, engines: int, seed: int, steps: int = 6, G: int = 4, B: int = 3,
        dispatch: dict | None = None, samples: int = 0, straggler: int = 0):
    """`dispatch`: more of the routing's table; `samples`: responses per prompt in the trace (default G);
    `straggler`: the first sample of every eighth prompt has this many tokens."""
    rng = random.Random(seed)
    rows = tuple((16, tuple(straggler if straggler and j % 8 == 0 and k == 0 else rng.choice([3, 8, 20, 60, 250])
                            for k in range(samples or G))) for j in range(16))
    backend = SimBackend(sim_cost(), TraceWorkload("t", rows), engines, 1, seed=seed, counters_every_s=0.02)
    counter = iter(range(10**6))
    source = lambda n: [PromptItem(i % 16, RunList.of(1, 16), None) for i in (next(counter) for _ in range(n))]
    tables = sched.preset_tables(preset)
    over = {k: {"eta": eta, **({"period_s": 0.0} if "period_s" in t else {})} for k, t in tables.items() if "eta" in t}
    if dispatch:
        over["dispatch"] = {**over.get("dispatch", {}), **dispatch}
    p = sched.load_preset(preset, over)
    trained: list = []
    train = backend.train

    def record(call, groups):
        trained.append((ctl.v.trainer.version, groups, {r.group_id * 100 + r.sample_index: r.v_traj
                                                        for r in ctl.v.requests.values()}))
        train(call, groups)
    backend.train = record
    log = EventLog()
    ctl = Controller(p, source, group_size=G, prompts_per_step=B, total_steps=steps, log=log)
    ctl.run(backend)
    return ctl, log.events, trained


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(preset=st.sampled_from(["staleflow", "staleflow_vanilla", "areal"]), eta=st.integers(0, 3),
       engines=st.integers(1, 3), seed=st.integers(0, 10**6))
def test_random_schedules_never_train_a_trajectory_staler_than_eta(preset, eta, engines, seed):
    ctl, events, trained = run(preset, eta, engines, seed)
    assert ctl.v.trainer.steps_done == 6
    seen = set()
    for version, groups, v_traj in trained:
        assert len(groups) == 3
        for g in groups:
            assert sorted(t.sample_index for t in g.trajectories) == [0, 1, 2, 3]
            for t in g.trajectories:
                assert (g.group_id, t.sample_index) not in seen
                seen.add((g.group_id, t.sample_index))
                assert 0 <= version - min(t.versions) <= eta                 # the controller's bound
                assert list(t.versions) == sorted(t.versions)                # tokens never go back in version
                vt = v_traj[g.group_id * 100 + t.sample_index]
                assert vt <= min(t.versions) and version - vt <= eta          # V_buf - V_traj <= eta (§4.2)
    # a resumed trajectory carries every token of its parts
    for e in events:
        if e.kind == "trajectory_interrupted":
            assert len(e.payload.response_ids) == len(e.payload.versions) == e.data["tokens"]


def test_staleflow_interrupts_and_resumes_and_reaches_the_bound():
    ctl, events, trained = run("staleflow", 2, 3, seed=1, steps=8)
    assert any(e.kind == "trajectory_interrupted" for e in events)
    stale = [version - min(t.versions) for version, groups, _ in trained for g in groups for t in g.trajectories]
    assert max(stale) == 2
    full = {(g.group_id, t.sample_index): len(t.response_ids) for _, groups, _ in trained for g in groups
            for t in g.trajectories}
    for e in events:   # every interrupted-then-trained trajectory finished with its full workload length
        if e.kind == "trajectory_interrupted" and (e.group_id, e.payload.sample_index) in full:
            assert full[(e.group_id, e.payload.sample_index)] >= e.data["tokens"]


def test_a_coupled_design_has_one_parameter_set_and_needs_its_partners():
    p = sched.load_preset("staleflow", {"dispatch": {"eta": 1}})       # set once, in the routing's table
    assert [q.staleness_bound() for q in p.policies().values()] == [1, None, None, None, None]
    assert p.design is p.dispatch and p.dispatch.sync is p.weight_sync and p.dispatch.migration is p.rebalance
    assert p.handoff.state is p.dispatch.state
    q = sched.load_preset("staleflow_vanilla")                         # its rebalance `none` is asked as usual
    assert q.design is q.dispatch and q.dispatch.sync is q.weight_sync and q.dispatch.migration is None
    with pytest.raises(ValueError, match="sched.handoff.eta .*'staleflow' takes no parameters"):
        sched.load_preset("staleflow", {"handoff": {"eta": 1}})       # no second eta that could disagree
    with pytest.raises(ValueError, match="needs a StaleFlow routing dispatch .* dispatch is 'fifo'"):
        sched.load_preset("sync", {"weight_sync": {"name": "staleflow"}})
    with pytest.raises(ValueError, match="areal handoff takes its staleness bound from the areal dispatch"):
        sched.load_preset("sync", {"handoff": {"name": "areal"}})
    q = sched.load_preset("areal", {"dispatch": {"eta": 2}})
    assert q.handoff.dispatch is q.dispatch and q.dispatch.staleness_bound() == 2


def test_areal_hand_off_waits_rather_than_strand_an_old_group():
    v = Views(group_size=1, prompts_per_step=2)
    v.trainer.version = 2
    for gid, (ver, done) in enumerate([(0, False), (1, True), (1, True), (2, True)]):
        g = GroupState(gid, gid, 0, 1, req_ids=[gid])
        v.requests[gid] = Request(gid, gid, 0, gid, 0, 4, state="finished" if done else "running", v_traj=ver)
        if done:
            g.scored, g.materialized_seq = 1, gid
            g.trajectories = [Trajectory(gid, 0, [1], [2], [-1.0], [ver], "stop")]
        v.groups[gid] = g                         # indexed (open / ready) as it is inserted
    D, H = sched.REGISTRY["dispatch"]["areal"], sched.REGISTRY["handoff"]["areal"]
    h = H()
    h.bind(SimpleNamespace(dispatch=D(D.Params(eta=2))))
    assert h.ready(v) is None                     # group 0 (version 0) is due now and not finished
    g0 = v.groups[0]
    g0.scored, g0.materialized_seq = 1, 9
    g0.trajectories = [Trajectory(0, 0, [1], [2], [-1.0], [0], "stop")]
    v.groups.track(g0)
    v.materialized += 1                           # as the lifecycle counts it (the hand-off's "anything new?")
    assert h.ready(v) == [0, 1]                   # oldest first


def test_areal_dispatch_caps_groups_per_engine_at_areals_max_concurrent_rollouts():
    # 2 engines, batch of 4 groups of 2: AReaL's default cap is one batch (4 groups) over all engines, 2 per engine
    def views(running_on_0: int) -> Views:
        v = Views(group_size=2, prompts_per_step=4)
        v.engines = [EngineView(0, version=0), EngineView(1, version=0)]
        rid = 0
        for gid in range(8):
            for k in range(2):
                state, eng = ("running", 0) if gid < running_on_0 else ("pending", -1)
                v.requests[rid] = Request(rid, gid, k, gid, 0, 4, state=state, engine=eng)
                rid += 1
        v.engines[0].assigned = 2 * running_on_0
        return v

    D = sched.REGISTRY["dispatch"]["areal"]
    subs = D(D.Params(eta=3)).admit(views(0))
    assert [(s.engine, len(s.req_ids)) for s in subs] == [(0, 4), (1, 4)]     # 2 groups each, then the cap
    subs = D(D.Params(eta=3)).admit(views(2))                                   # engine 0 already holds 2 groups
    assert [(s.engine, len(s.req_ids)) for s in subs] == [(1, 4)]
    subs = D(D.Params(eta=3, max_concurrent_rollouts=16)).admit(views(0))      # explicit cap: 8 per engine
    assert sum(len(s.req_ids) for s in subs) == 16                              # every pending group admitted


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), engines=st.integers(1, 3), per_engine=st.integers(0, 3),
       eta=st.integers(0, 3))
def test_areal_live_group_counts_kept_from_finishes_equal_a_recount_at_every_admission(seed, engines, per_engine,
                                                                                      eta):
    """`_live_groups` reads only the finishes since its last call (and recounts an engine whose books disagree with
    its `assigned`): at every call its counts equal a count from scratch over the requests on each engine, on
    random simulated workloads."""
    from tests.support.offpolicy_sim import sim_run
    D = sched.REGISTRY["dispatch"]["areal"]
    real = D._live_groups
    calls = []

    def checked(self, v):
        got = real(self, v)
        want = {e.engine: len({r.group_id for r in v.requests.in_state(*ON_ENGINE) if r.engine == e.engine})
                for e in v.engines}
        assert got == want, (got, want)
        calls.append(1)
        return got

    D._live_groups = checked
    try:
        ctl, _, _ = sim_run("areal", seed, engines, 3, 4, 5, {"dispatch": {"eta": eta, "per_engine": per_engine}})
    finally:
        D._live_groups = real
    assert ctl.v.trainer.steps_done == 5 and calls


def test_migration_never_moves_a_trajectory_waiting_on_a_tool_and_discard_keeps_the_counts():
    """Multi-turn: a request on a tool call is RUNNING but neither decodes nor queues (its call would start over
    where it lands). Case 1 takes the wait queue's excess from what decodes or queues; Case 2 drains only that."""
    mig = StaleFlowMigration()
    # Case 1: 5 queued (phi_wait 3): the excess 2 come from the movable ids, never the two on tools (ids 8, 9)
    s = InstanceSnap(0, 1, running=2, waiting=5, kv=1e3, requests=(8, 9, 1, 2, 3, 4, 5, 6, 7), on_tool=2)
    assert mig.select({0: s}, ThroughputModel()) == [(0, [6, 7])]
    few = InstanceSnap(0, 1, running=0, waiting=5, kv=1e3, requests=(8, 9, 10, 11, 12, 13, 14), on_tool=7)
    assert mig.select({0: few}, ThroughputModel()) == []
    # Case 2: the fast instance is drained of what it decodes, not of its tool waiters
    fast = InstanceSnap(0, 1, running=200, kv=1e3, requests=(500, 501) + tuple(range(200)), on_tool=2)
    slow = InstanceSnap(1, 1, running=1, kv=1e6, requests=(300,))
    (moved,) = mig.select({0: fast, 1: slow}, ThroughputModel())
    assert moved == (0, list(range(200)))
    d = discard(s, [9, 7, 6])
    assert (d.running, d.waiting, d.on_tool, d.requests) == (2, 3, 1, (8, 1, 2, 3, 4, 5))

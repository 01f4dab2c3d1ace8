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
            assert len(t.versions) >= n and all(u <= e.version for u in t.versions[:n])
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


# ---- adaptive in-flight concurrency (prime-rl) ----------------------------------------------------------------
def concurrency(**kw):
    D = sched.REGISTRY["dispatch"]["adaptive_concurrency"]
    return D(D.Params(**{"lag": 9, "max_inflight": 100, "initial_inflight": 40, "poll_s": 5.0, **kw}))


def engines_views(pending_groups: int = 0) -> Views:
    """Two engines at version 0 of 100 KV blocks of 16 tokens each (C = 3200 tokens); groups of 4, batch 2;
    `pending_groups` groups waiting."""
    v = Views(group_size=4, prompts_per_step=2, kv_block_size=16)
    v.engines = [EngineView(0, version=0, kv_used=30, kv_free=70), EngineView(1, version=0, kv_used=0, kv_free=100)]
    for gid in range(pending_groups):
        v.groups[gid] = GroupState(gid, gid, 0, 4, req_ids=list(range(4 * gid, 4 * gid + 4)))
        for i in range(4):
            v.requests[4 * gid + i] = Request(4 * gid + i, gid, i, gid, 0, 40)
    return v


def test_adaptive_concurrency_moves_its_cap_with_kv_pressure_hand_computed():
    """prime-rl's rules on numbers worked by hand: a HARD poll (preemptions rose) cuts n_max to 0.75 x in flight,
    no second cut before the drain, half again if HARD survives the drain; the first step's end sets
    kappa = max(1, n_max G / C); a step of CLEAR polls with the cap binding grows kappa by 2%; the clamp holds."""
    d, v = concurrency(), engines_views()
    d.admit(v)
    assert d.cap == 40                                            # initial_inflight, first poll CLEAR
    v.engines[0].assigned, v.engines[1].assigned, v.engines[0].preemptions, v.now = 20, 16, 3, 5.0
    d.admit(v)
    assert d.cap == 0.75 * 36 == 27 and d.frozen                  # HARD: cut to 0.75 x 36 in flight
    v.engines[0].assigned, v.engines[0].preemptions, v.now = 14, 4, 10.0   # 30 in flight >= 27: still draining
    d.admit(v)
    assert d.cap == 27
    v.engines[0].assigned, v.engines[0].preemptions, v.now = 4, 5, 15.0    # 20 < 27 and HARD again: halve
    d.admit(v)
    assert d.cap == 13.5
    v.engines[1].assigned, v.now = 6, 20.0                                # 10 in flight, CLEAR: the freeze lifts
    d.admit(v)
    assert d.cap == 13.5 and not d.frozen
    # one request finished: prompt 40 + 360 tokens, so G = 400; the first step ends (version 1)
    v.requests[99] = Request(99, 0, 0, 0, 0, 40, state="finished", tokens=360)
    v.finishes[0] = [99]
    v.trainer.version = 1
    d.admit(v)
    assert d.g == 400 and d.kappa == max(1.0, 13.5 * 400 / 3200) and d.cap == 1.6875 * 3200 / 400
    # step 2: every poll CLEAR and one binding (13 >= 0.9 x 13.5): kappa x 1.02
    v.engines[1].assigned, v.now = 9, 25.0
    d.admit(v)
    assert d.bound and d.clear
    v.trainer.version = 2
    d.admit(v)
    assert abs(d.kappa - 1.6875 * 1.02) < 1e-12 and abs(d.cap - 1.6875 * 1.02 * 8) < 1e-9
    # the clamp: group_size <= n_max <= max_inflight
    d.kappa, d.clear, d.bound, v.trainer.version = 50.0, False, False, 3
    d.admit(v)
    assert d.cap == 100
    v.engines[0].assigned = v.engines[1].assigned = 0
    v.engines[1].preemptions, v.now, d.frozen = 1, 40.0, False
    d.admit(v)
    assert d.cap == 4                                             # 0.75 x 0 in flight, floored at group_size


def test_adaptive_concurrency_admits_whole_groups_only_within_its_cap():
    d, v = concurrency(initial_inflight=10), engines_views(pending_groups=4)
    subs = d.admit(v)
    assert sum(len(s.req_ids) for s in subs) == 8                 # two groups of 4: a third would make 12 > 10
    assert d.inflight == 8


def tight_kv_run(seed: int, engines: int, kv_blocks: int, initial: int, max_inflight: int):
    """A long-tail workload on engines whose KV pool holds `kv_blocks` blocks of 16 tokens; the dispatch's cap and
    the requests it held after each decision recorded."""
    import random

    from sched.controller import PromptItem
    from sched.events import EventLog
    from sim.backend import SimBackend
    from sim.cost import CostModel, RewardLatency, RewardTask
    from sim.tokens import RunList
    from tests.support.offpolicy_sim import Recorder, random_workload
    rng = random.Random(seed)
    w = random_workload(rng, 64, 4)
    cost = CostModel(name="tight", k1=1e-7, k2=1e-2, k3=1e-4, k4=1e-3, prefill_s_per_token=1e-5,
                     kv_capacity_tokens=16 * kv_blocks, train_s_per_token=1e-4, publish_s=0.2, load_s=0.05,
                     reward=RewardLatency((RewardTask("math", 1.0, 0.01, 1.5, 5.0),)), block_size=16, max_num_seqs=64)
    backend = SimBackend(cost, w, engines, 1, seed=seed, counters_every_s=0.5)
    counter = iter(range(10**9))

    def source(n: int) -> list[PromptItem]:
        return [PromptItem(i % 64, RunList.of(1, w.prompt(i % 64).prompt_len), None)
                for i in (next(counter) for _ in range(n))]

    admissions: list[tuple[int, int, float]] = []     # (in flight before, after, cap) of every decision that placed

    class Watch(Recorder):
        def decide(self, b) -> None:
            before = sum(e.assigned for e in self.v.engines)
            super().decide(b)
            after = sum(e.assigned for e in self.v.engines)
            d = self.preset.dispatch
            lo, hi = d.limits(self.v)
            assert lo <= d.cap <= hi
            if after > before:
                admissions.append((before, after, d.cap))

    preset = sched.load_preset("adaptive_concurrency", {"dispatch": {
        "lag": 3, "initial_inflight": initial, "max_inflight": max_inflight, "poll_s": 1.0}})
    log = EventLog()
    ctl = Watch(preset, source, group_size=4, prompts_per_step=4, total_steps=6, log=log)
    ctl.run(backend)
    return ctl, log.events, w, admissions


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), engines=st.integers(1, 3), kv_blocks=st.sampled_from([40, 80, 4000]),
       initial=st.sampled_from([4, 16, 64]), max_inflight=st.sampled_from([0, 24, 96]))
def test_adaptive_concurrency_cap_follows_preemptions_within_its_limits(seed, engines, kv_blocks, initial,
                                                                       max_inflight):
    """On random long-tail schedules: n_max stays within [group_size, max_inflight] after every decision; every
    decision that placed requests left at most n_max in flight; every HARD cut follows a rise of some engine's
    reported preemptions since the previous poll, so a schedule without preemptions never cuts; nothing is lost."""
    ctl, events, w, admissions = tight_kv_run(seed, engines, kv_blocks, initial, max_inflight)
    d = ctl.preset.dispatch
    assert ctl.v.trainer.steps_done == 6
    assert all(after <= cap for _, after, cap in admissions)
    reported: list[tuple[float, int, int]] = [(e.t, e.engine, e.data["preemptions"]) for e in events
                                              if e.kind == "tokens_decoded"]
    for t, _, why in d.history:
        if why.startswith("hard"):
            assert any(p > 0 and when <= t for when, _, p in reported)
    if not any(p for _, _, p in reported):
        assert not any(why.startswith("hard") for _, _, why in d.history)
    check_nothing_lost(ctl, events, w)


def test_adaptive_concurrency_cuts_under_kv_pressure_and_not_without_it():
    """One schedule, two KV pools: the tight pool preempts and the cap is cut below where it started; the roomy
    one never preempts and never cuts."""
    tight, _, _, _ = tight_kv_run(5, 2, 40, 64, 0)
    roomy, _, _, _ = tight_kv_run(5, 2, 4000, 64, 0)
    assert tight.v.engines[0].preemptions + tight.v.engines[1].preemptions > 0
    assert tight.preset.dispatch.stats()["hard_cuts"] > 0 and tight.preset.dispatch.stats()["n_max_low"] < 64
    assert roomy.v.engines[0].preemptions + roomy.v.engines[1].preemptions == 0
    assert roomy.preset.dispatch.stats()["hard_cuts"] == 0

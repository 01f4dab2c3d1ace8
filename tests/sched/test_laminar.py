"""Laminar: Best-Fit repack (Algorithm 1 with the chained-move guard), per-engine batches with pull-latest weight
sync (no barrier), the experience buffer; property tests drive the preset through the simulator with random
workloads, KV sizes and timings, and check the invariants on what the trainer received and on the event log."""
from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import sched
from sched.policies.laminar.rebalance import EngineCheck, best_fit, candidates
from sched.views import RequestState
from tests.support.offpolicy_sim import check_nothing_lost, sim_run, trained_trajectories

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -------------------------------------------------------------------------------------------- Algorithm 1 (pure)
def snap(engine, c, n, prev=1.0, version=0, waiting=0):
    return EngineCheck(engine, version, c, prev, n, waiting)


def test_best_fit_packs_smallest_first_onto_the_densest_that_fits():
    s = [snap(0, 0.10, 2), snap(1, 0.30, 5), snap(2, 0.50, 9), snap(3, 0.95, 1, prev=0.9)]  # 3: not ramping down
    assert [x.engine for x in candidates(s, 0.99, 64)] == [0, 1, 2]
    # 0 -> densest that fits = 2 (0.5 + 0.1); then 1 fits on 2 (0.6 + 0.3 <= 0.99); 2 is a destination: skipped
    assert best_fit(s, 0.99, 64) == [(0, 2), (1, 2)]
    assert best_fit(s, 0.99, 12) == [(0, 2)]     # 9 + 2 + 5 > 12: engine 1 stays where it is


def test_best_fit_respects_kv_and_batch_capacity():
    s = [snap(0, 0.5, 3), snap(1, 0.6, 3)]
    assert best_fit(s, 0.99, 64) == []           # 0.5 + 0.6 > C_max
    s = [snap(0, 0.4, 3), snap(1, 0.5, 3)]
    assert best_fit(s, 1.0, 5) == []             # 3 + 3 > B
    assert best_fit(s, 1.0, 6) == [(0, 1)]       # 3 + 3 <= B, 0.9 <= C_max
    assert best_fit(s, 0.85, 6) == []            # 0.9 > C_max
    assert best_fit(s, 1.0, 3) == []             # N_reqs < B (line 1) excludes both


def test_the_guard_stops_a_chained_move_that_the_printed_algorithm_makes():
    # 0 -> 2 (densest that fits, 0.35); 1 fits nowhere (2 would reach 0.55, 0 is emptied); then 2, a destination
    # with 0's trajectories promised to it, would be moved onto 1 by the printed algorithm: a chained move.
    chained = [snap(0, 0.10, 1), snap(1, 0.20, 1), snap(2, 0.25, 1)]
    assert best_fit(chained, 0.45, 64) == [(0, 2)]
    assert best_fit(chained, 0.45, 64, guard=False) == [(0, 2), (2, 1)]
    assert best_fit([snap(0, 0.10, 1), snap(1, 0.20, 1), snap(2, 0.60, 1)], 0.75, 64) == [(0, 2)]


def test_alg1_needs_a_kv_decrease_and_drained_needs_an_empty_queue():
    assert candidates([snap(0, 0.5, 2, prev=0.4)], 0.99, 64) == []
    assert candidates([snap(0, 0.5, 2, prev=0.4)], 0.99, 64, "drained") != []
    assert candidates([snap(0, 0.5, 2, prev=0.4, waiting=1)], 0.99, 64, "drained") == []
    assert candidates([snap(0, 0.3, 0, prev=0.4)], 0.99, 64) == []       # nothing to move
    with pytest.raises(ValueError):
        best_fit([snap(0, 0.1, 1), snap(1, 0.1, 1, version=1)], 0.99, 64)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), st.integers(0, 80), st.integers(0, 2)), max_size=12),
       st.floats(0.3, 1.0), st.integers(1, 80), st.sampled_from(["alg1", "drained"]))
def test_best_fit_plans_are_feasible_and_never_chain(rows, c_max, b, rule):
    snaps = [snap(i, c, n, prev=p, waiting=w) for i, (c, p, n, w) in enumerate(rows)]
    plan = best_fit(snaps, c_max, b, rule)
    by = {s.engine: s for s in snaps}
    srcs, dsts = [s for s, _ in plan], {d for _, d in plan}
    cand = {s.engine for s in candidates(snaps, c_max, b, rule)}
    assert len(srcs) == len(set(srcs)) and not set(srcs) & dsts            # no engine both source and destination
    assert set(srcs) | dsts <= cand
    for d in dsts:
        inflow = [by[s] for s, dd in plan if dd == d]
        assert by[d].c_used + sum(s.c_used for s in inflow) <= c_max + 1e-9
        assert by[d].n_reqs + sum(s.n_reqs for s in inflow) <= b


# ------------------------------------------------------------------------------------ the preset in the simulator
def laminar_checks(moves: list):
    """After every decision: (a) no engine idles behind a barrier: each one either holds trajectories, is loading
    weights, has repacked trajectories on their way to it, or the run is over; (b) every pending migration goes
    between two engines of the same version, which is not loading."""
    def check(ctl):
        v = ctl.v
        if v.trainer.steps_done >= ctl.total_steps or v.trainer.published < 0:
            return
        for e in v.engines:
            assert e.assigned > 0 or e.loading or v.migrating_to(e.engine), \
                f"engine {e.engine} idle at t={v.now:.3f} (version {e.version}, published {v.trainer.published})"
        for r in v.requests.in_state(RequestState.INTERRUPTING):
            if r.migrate_to >= 0:
                assert v.engines[r.engine].version == v.engines[r.migrate_to].version == r.version
                assert not v.engines[r.migrate_to].loading
                moves.append(r.req_id)
    return check


@SETTINGS
@given(seed=st.integers(0, 2**31), engines=st.integers(2, 5), group_size=st.integers(1, 4),
       prompts=st.integers(1, 6), steps=st.integers(1, 6), period=st.sampled_from([0.05, 0.5, 5.0]),
       rule=st.sampled_from(["alg1", "drained"]), c_max=st.sampled_from([0.6, 0.99]),
       batch_groups=st.integers(0, 3))
def test_laminar_repack_keeps_versions_strands_nothing_and_trains_each_trajectory_once(
        seed, engines, group_size, prompts, steps, period, rule, c_max, batch_groups):
    moves: list = []
    ctl, events, w = sim_run("laminar", seed, engines, group_size, prompts, steps,
                             {"rebalance": {"period_s": period, "idle_rule": rule, "c_max": c_max},
                              "dispatch": {"batch_groups": batch_groups}}, check=laminar_checks(moves))
    assert ctl.v.trainer.steps_done == steps
    check_nothing_lost(ctl, events, w)
    for t in trained_trajectories(ctl).values():
        assert len(set(t.versions)) == 1, "a Laminar trajectory mixes weight versions"
    # from the log: every interrupt is a migration that landed on an engine of the trajectory's own version
    version_of = {}
    for e in events:
        if e.kind == "weights_loaded":
            version_of[e.engine] = e.version
        elif e.kind == "trajectory_interrupted":
            version_of[("int", e.req_id)] = e.version
        elif e.kind == "trajectory_migrated":
            assert e.version == version_of.pop(("int", e.req_id)) == version_of[e.data["src"]]
    stranded = [k for k in version_of if isinstance(k, tuple)]
    assert not [k for k in stranded if ctl.v.requests.get(k[1]) is not None and ctl.v.requests[k[1]].state
                in ("pending", "interrupting")], "an interrupted trajectory was never resubmitted"
    # every engine batch is whole groups, admitted to one engine
    first = {}
    for e in events:
        if e.kind == "request_admitted" and e.req_id not in first:
            first[e.req_id] = (e.group_id, e.engine)
    per_group = defaultdict(set)
    for g, eng in first.values():
        per_group[g].add(eng)
    assert all(len(s) == 1 for s in per_group.values()), "a group spans engines at admission"


def test_repack_actually_moves_long_tails_and_frees_engines():
    """The property test above is not vacuous: on a long-tailed workload repack migrates trajectories, and the
    sources then pull newer weights and take new batches while the destinations finish the tails."""
    moves: list = []
    total = 0
    for seed in range(6):
        ctl, events, w = sim_run("laminar", seed, 4, 4, 4, 6, {"rebalance": {"period_s": 0.2, "idle_rule": "drained"}},
                                 check=laminar_checks(moves))
        total += sum(1 for e in events if e.kind == "trajectory_migrated")
    assert total > 0 and moves


def test_engines_pull_latest_on_their_own_and_never_load_under_a_trajectory():
    ctl, events, _ = sim_run("laminar", 3, 4, 2, 4, 8)
    held = defaultdict(int)
    loads_per_version = defaultdict(set)
    t_of = {}
    for e in events:
        if e.kind == "request_admitted":
            held[e.engine] += 1
        elif e.kind in ("trajectory_finished", "trajectory_interrupted"):
            held[e.engine] -= 1
        elif e.kind == "weights_loaded":
            assert held[e.engine] == 0, "weights loaded under a running trajectory"
            loads_per_version[e.version].add(e.engine)
            t_of[(e.engine, e.version)] = e.t
    # no global sync: engines adopt a version at different times
    spread = [max(t_of[(g, v)] for g in es) - min(t_of[(g, v)] for g in es)
              for v, es in loads_per_version.items() if len(es) > 1]
    assert any(s > 0 for s in spread)


def test_experience_buffer_hands_exactly_b_groups_oldest_materialised_first():
    ctl, events, _ = sim_run("laminar", 5, 3, 2, 3, 6, {"handoff": {"groups": 2}})
    seq = {e.group_id: i for i, e in enumerate(x for x in events if x.kind == "group_materialized")}
    consumed = []
    for _, call, groups in ctl.calls:
        assert len(groups) == 2 and call.step and call.publish
        consumed += [g.group_id for g in groups]
    # FIFO: a group is never trained before one that materialised earlier and is still waiting
    assert [seq[g] for g in consumed] == sorted(seq[g] for g in consumed)


def test_laminar_preset_state_round_trips():
    p = sched.load_preset("laminar")
    p.rebalance.moves = 7
    q = sched.load_preset("laminar")
    q.rebalance.load_state_dict(p.rebalance.state_dict())
    assert q.rebalance.moves == 7


@pytest.mark.parametrize("how", ["oldest", "fifo"])
def test_a_full_experience_buffer_evicts_whole_groups_in_its_order_and_never_trains_them(how, monkeypatch):
    """A buffer of C groups (Laminar §3.1's capacity and eviction): after every decision at most C materialised
    groups wait; the excess is dropped as whole groups (counted, never trained), the stalest version first
    (`oldest`) or the longest waiting first (`fifo`); the trainer still gets exactly B groups per batch."""
    from sched.policies.laminar.handoff import ExperienceBuffer
    cap, evictions, pending = 3, [], []
    real = ExperienceBuffer.evict

    def spy(self, v):
        self.refresh(v)
        before = [(g.group_id, g.version, g.materialized_seq) for g in self.buf]
        owner = {rid: g.group_id for g in self.buf for rid in g.req_ids}
        out = real(self, v)
        if out:
            victims = sorted({owner[rid] for a in out for rid in a.req_ids})
            evictions.append((before, victims))
            pending.extend(victims)
        return out
    monkeypatch.setattr(ExperienceBuffer, "evict", spy)

    def check(ctl):
        v = ctl.v
        waiting = [g for g in v.groups.values() if g.materialized and not g.consumed and not g.void]
        assert len(waiting) <= cap
        for gid in pending:                       # evicted in this decision: every sample dropped (if not pruned)
            assert v.groups.get(gid) is None or v.groups[gid].void
        pending.clear()

    evicted_all = 0
    for seed in range(3):
        evictions.clear()
        ctl, events, _ = sim_run("laminar", seed, 6, 2, 2, 8, {"handoff": {"capacity": cap, "evict": how}},
                                 check=check)
        assert len(ctl.calls) == 8 and all(len(gs) == 2 for _, _, gs in ctl.calls)
        trained = {g.group_id for _, _, gs in ctl.calls for g in gs}
        key = (lambda r: (r[1], r[2], r[0])) if how == "oldest" else (lambda r: (r[2], r[0]))
        for before, victims in evictions:
            assert len(before) - len(victims) == cap                                        # exactly the excess
            assert victims == sorted(r[0] for r in sorted(before, key=key)[:len(victims)])  # in the order
            assert not set(victims) & trained                                              # never trained
            evicted_all += len(victims)
        dropped = {e.group_id for e in events if e.kind == "trajectory_aborted"}
        assert dropped == {g for _, victims in evictions for g in victims}
    assert evicted_all > 0, "the trainer never fell behind: nothing was evicted"


def test_an_experience_buffer_smaller_than_a_batch_is_a_named_error():
    with pytest.raises(ValueError, match="handoff.capacity = 1 is less than a training batch of 2 groups"):
        sim_run("laminar", 0, 2, 2, 2, 2, {"handoff": {"capacity": 1}})

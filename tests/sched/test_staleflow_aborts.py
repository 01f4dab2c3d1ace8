"""StaleFlow's staleness-manager Abort (§4.3, Fig. 8b-c; sched/policies/staleflow/aborts.py): batch and group
redundancy, the uniform-reward filter and the stuck-buffer filter, on hand-built buffers and on whole simulated
runs, with what the trainer received checked against the rules."""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest

import sched
from sched.policies.staleflow.aborts import spare
from sched.policies.staleflow.buffers import READY, STUCK, StalenessBuffers
from tests.sched.test_staleflow import run


def test_app_c_redundancy_ratio_gives_the_papers_counts():
    assert spare(128, 1 / 16) == 8 and 128 + spare(128, 1 / 16) == 136    # batch level: 136 groups per step
    assert 16 + spare(16, 1 / 16) == 17                                    # group level: 17 trajectories per group
    assert spare(128, 0.0) == 0 and spare(3, 0.5) == 2


def test_a_buffer_with_spare_entries_is_ready_at_batch_and_drops_its_reservations_as_surplus():
    sb = StalenessBuffers(eta=0, batch=2, extra=2)
    for k in range(4):
        assert sb.reserve(k, 0) == 0
    assert not sb.can_assign(0)                        # four slots, all reserved
    sb.complete(2)
    assert sb.state(0) == STUCK                        # full, one occupied of the two the batch needs
    sb.complete(0)
    assert sb.state(0) == READY and sorted(sb.surplus) == [1, 3]   # the batch is occupied: the rest is surplus
    assert 1 not in sb.loc and 3 not in sb.loc and not sb.can_assign(0)
    sb.check()
    assert sorted(sb.consume()) == [0, 2]


def test_filtering_an_occupied_entry_pulls_a_later_one_forward_and_may_make_its_buffer_ready():
    sb = StalenessBuffers(eta=1, batch=2, extra=1)
    for k in range(5):
        sb.reserve(k, 0)                               # latest first: three into buffer 1, two into buffer 0
    for k in (0, 1, 2):
        sb.complete(k)
    assert sb.state(0) == READY
    sb.surplus.clear()
    sb.remove(0)                                       # filtered: the hole in buffer 0 is refilled from buffer 1
    sb.check()
    assert sb.where(0) is None and sb.occupied(0) == 2 and sb.state(0) == READY


def trained_groups(trained):
    return [g for _, groups, _ in trained for g in groups]


def test_batch_redundancy_trains_exactly_the_batch_and_aborts_the_surplus_groups():
    ctl, events, trained = run("staleflow", 1, 2, seed=3, steps=6, B=4, dispatch={"batch_redundancy": 0.5})
    assert ctl.v.trainer.steps_done == 6
    assert all(len(groups) == 4 for _, groups, _ in trained)
    stats = ctl.preset.dispatch.stats()
    assert stats["surplus_groups"] > 0
    trained_ids = {g.group_id for g in trained_groups(trained)}
    aborted = {e.group_id for e in events if e.kind == "trajectory_aborted"}
    assert aborted and not aborted & trained_ids       # an aborted group is never trained
    for rid in {e.req_id for e in events if e.kind == "trajectory_aborted"}:   # never back in the TS (fn. 2)
        admitted = [i for i, e in enumerate(events) if e.kind == "request_admitted" and e.req_id == rid]
        gone = min(i for i, e in enumerate(events) if e.kind == "trajectory_aborted" and e.req_id == rid)
        assert all(i < gone for i in admitted)


def test_group_redundancy_keeps_each_groups_first_g_finishers_and_aborts_the_rest():
    G = 4
    ctl, events, trained = run("staleflow", 1, 2, seed=5, steps=5, G=G, dispatch={"group_redundancy": 0.5},
                               samples=6)
    assert ctl.v.trainer.steps_done == 5
    sample_of = {e.req_id: e.payload.sample_index for e in events if e.kind == "reward_scored"}
    finish_order: dict[int, list[int]] = defaultdict(list)
    for e in events:
        if e.kind == "round_started":
            assert e.data["group_size"] == 6                   # G + ceil(0.5 G)
        if e.kind == "trajectory_finished":
            finish_order[e.group_id].append(sample_of[e.req_id])
    aborted = Counter(e.group_id for e in events if e.kind == "trajectory_aborted")
    later = set()
    for g in trained_groups(trained):
        kept = sorted(t.sample_index for t in g.trajectories)
        assert len(kept) == G
        assert kept == sorted(finish_order[g.group_id][:G])   # the first G to finish, whatever their index
        assert aborted[g.group_id] == 6 - G
        later |= set(kept) - set(range(G))
    assert later, "every kept trajectory was among the first G sampled: the race was never exercised"
    assert ctl.preset.dispatch.stats()["surplus_samples"] >= 2 * len(trained_groups(trained))


def test_the_uniform_reward_filter_trains_only_groups_with_a_learning_signal_and_still_fills_every_batch():
    ctl, events, trained = run("staleflow", 1, 2, seed=7, steps=6, dispatch={"filter_uniform": True})
    assert ctl.v.trainer.steps_done == 6 and all(len(groups) == 3 for _, groups, _ in trained)
    for g in trained_groups(trained):
        assert len({t.reward for t in g.trajectories}) > 1
    assert ctl.preset.dispatch.stats()["filtered_uniform"] > 0
    # without the filter the same run trains uniform groups: the filter, not luck, removed them
    _, _, plain = run("staleflow", 1, 2, seed=7, steps=6)
    assert any(len({t.reward for t in g.trajectories}) == 1 for g in trained_groups(plain))


def test_the_filter_judges_a_redundant_group_by_the_samples_it_keeps():
    """With group redundancy a group's surplus may finish and be scored before its Abort lands (on real ranks a
    whole group often scores in one batch of events): the filter must look only at the first G finishers."""
    ctl, events, trained = run("staleflow", 1, 2, seed=7, steps=6, samples=6,
                               dispatch={"group_redundancy": 0.5, "filter_uniform": True})
    assert ctl.v.trainer.steps_done == 6
    for g in trained_groups(trained):
        assert len(g.trajectories) == 4 and len({t.reward for t in g.trajectories}) > 1
    stats = ctl.preset.dispatch.stats()
    assert stats["filtered_uniform"] > 0 and stats["surplus_samples"] > 0


@pytest.mark.parametrize("filter_s", [0.0, 0.5])
def test_the_stuck_filter_stops_training_from_waiting_on_a_straggler(filter_s):
    """eta = 0 and one prompt in eight with a 3000-token sample: without the filter every batch holding it waits
    for it; with a 0.5 s filter the Stuck buffer drops the straggler's group and fills from later ones."""
    ctl, events, trained = run("staleflow", 0, 2, seed=11, steps=4, dispatch={"stuck_filter_s": filter_s},
                               straggler=3000)
    assert ctl.v.trainer.steps_done == 4
    longest = max(len(t.response_ids) for g in trained_groups(trained) for t in g.trajectories)
    stats = ctl.preset.dispatch.stats()
    if filter_s:
        assert stats["filtered_stuck"] > 0 and longest < 3000
    else:
        assert "filtered_stuck" not in stats and longest == 3000


def test_the_redundancy_knobs_are_validated_by_name():
    with pytest.raises(ValueError, match="batch_redundancy"):
        sched.load_preset("staleflow", {"dispatch": {"batch_redundancy": -0.1}})


def test_a_group_scored_whole_before_its_surplus_abort_is_filtered_by_its_first_g_finishers():
    """All six samples of a G = 4 group finished and were scored in one batch of events (common on real ranks):
    its first four finishers all got reward 0, the two surplus ones 1. The group trains on the four, so it carries
    no signal and is filtered; the two surplus samples and the filtered four are all aborted."""
    from rl.types import Trajectory
    from sched.views import GroupState, Request, RequestState, Views
    p = sched.load_preset("staleflow", {"dispatch": {"group_redundancy": 0.5, "filter_uniform": True}})
    v = Views(group_size=4, prompts_per_step=1)
    g = GroupState(0, 0, 0, 6)
    v.groups[0] = g
    order = [5, 0, 3, 1, 2, 4]                          # finish order by sample index
    for s in range(6):
        v.requests[s] = Request(s, 0, s, 0, 0, 10, state=RequestState.FINISHED, engine=0, v_traj=0)
        g.req_ids.append(s)
    v.finishes[0] = list(order)
    for s in order:
        g.trajectories.append(Trajectory(0, s, [1], [2], [-0.1], [0], "stop", reward=0.0 if s in order[:4] else 1.0))
    g.scored, v.materialized = 6, 1
    p.dispatch.state.buffers(v).reserve(0, 0)
    aborts = p.handoff.evict(v)
    assert p.dispatch.state.buffers(v).where(0) is None             # filtered: no entry left
    assert sorted(i for a in aborts for i in a.req_ids) == list(range(6))
    assert p.dispatch.stats()["filtered_uniform"] == 1 and p.dispatch.stats()["surplus_samples"] == 2

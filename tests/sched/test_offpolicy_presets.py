"""The off-policy presets besides Laminar -- one-step off-policy (VeRL-Pipeline), StreamRL's asynchronous mode and
partial rollout -- driven through the simulator with random workloads and timings; and the off-policy event-log
checker that the real-rank runs (tests/e2e/test_presets_e2e.py) use, shown to catch what it is for."""
from __future__ import annotations

import json
from collections import Counter, defaultdict

from hypothesis import HealthCheck, given, settings, strategies as st

from sim.run import simulate
from tests.support.offpolicy_sim import check_nothing_lost, sim_run, trained_trajectories
from tests.support.offpolicy_log import check_offpolicy_log

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
common = dict(seed=st.integers(0, 2**31), engines=st.integers(1, 4), group_size=st.integers(1, 4),
              prompts=st.integers(1, 5), steps=st.integers(1, 5))


def sim_log(preset: str, **kw) -> list[dict]:
    r = simulate(preset, "cpu_tiny", "cpu_tiny", kw.pop("engines", 2), 2, steps=kw.pop("steps", 6), group_size=4,
                 prompts_per_step=4, seed=kw.pop("seed", 0), **kw)
    return [json.loads(e.to_json()) for e in r.events]


def test_log_checker_passes_the_presets_and_catches_a_double_handoff_and_a_lost_trajectory():
    for preset, bound in (("one_step", 1), ("streamrl_async", 1), ("partial_rollout", None), ("laminar", None)):
        rows = sim_log(preset)
        rep = check_offpolicy_log(rows, bound)
        assert rep["twice"] == rep["lost"] == rep["unreturned"] == rep["stale"] == rep["unmaterialised_trained"] \
            == [] and rep["trained_groups"], \
            (preset, rep)
    rows = sim_log("one_step")
    j = next(j for j, e in enumerate(rows) if e["kind"] == "train_started")
    bad = rows[:j + 1] + [rows[j]] + rows[j + 1:]                      # the same groups handed over twice
    assert check_offpolicy_log(bad)["twice"]
    g = rows[j]["data"]["groups"][0]
    i = next(i for i, e in enumerate(rows) if e["kind"] == "reward_scored" and e["group_id"] == g)
    assert check_offpolicy_log(rows[:i] + rows[i + 1:])["lost"]     # a trained group missing a finished sample
    assert check_offpolicy_log(rows, max_staleness=0)["stale"]       # one-step data is one version old


# --------------------------------------------------------------------------------------- property tests (sim)
def rounds_of(ctl):
    """Per train call: (trainer version, call, round of each group)."""
    return [(ver, call, {g.round for g in groups}) for ver, call, groups in ctl.calls]


@SETTINGS
@given(**common)
def test_one_step_trains_each_round_whole_in_order_one_version_old_at_most(seed, engines, group_size, prompts, steps):
    ctl, events, w = sim_run("one_step", seed, engines, group_size, prompts, steps)
    check_nothing_lost(ctl, events, w)
    rounds = rounds_of(ctl)
    assert [r for _, _, rs in rounds for r in rs] == list(range(len(rounds)))     # one round per call, in order
    for n, (ver, call, _) in enumerate(rounds):
        assert call.step and call.publish and ver == n
    for t in trained_trajectories(ctl).values():
        assert len(set(t.versions)) == 1
    for ver, _, groups in ctl.calls:
        for grp in groups:
            assert 0 <= ver - grp.version <= 1 and grp.version >= grp.round - 1       # generated on >= n - 1
    started = [e for e in events if e.kind == "round_started"]
    # a round starts only after the previous one is generated (every request of it finished)
    fin_t = defaultdict(float)
    req_round = {}
    for e in events:
        if e.kind == "request_admitted":
            req_round[e.req_id] = ctl_round(ctl, e.group_id)
        elif e.kind == "trajectory_finished" and e.req_id in req_round:
            fin_t[req_round[e.req_id]] = max(fin_t[req_round[e.req_id]], e.t)
    for e in started[1:]:
        n = e.data["round"]
        assert fin_t[n - 1] <= e.t


def ctl_round(ctl, gid):
    for ver, call, groups in ctl.calls:
        for g in groups:
            if g.group_id == gid:
                return g.round
    return -1


@SETTINGS
@given(**common)
def test_streamrl_async_steps_once_per_batch_and_stays_one_step_off(seed, engines, group_size, prompts, steps):
    ctl, events, w = sim_run("streamrl_async", seed, engines, group_size, prompts, steps)
    check_nothing_lost(ctl, events, w)
    per_round = defaultdict(list)
    for ver, call, groups in ctl.calls:
        (r,) = {g.round for g in groups}                                         # never mixes rounds
        per_round[r].append((ver, call))
        for g in groups:
            assert 0 <= ver - g.version <= 1
    for r, calls in per_round.items():
        assert [c.step for _, c in calls] == [False] * (len(calls) - 1) + [True]
        assert {v for v, _ in calls} == {r}
    assert sorted(per_round) == list(range(len(per_round)))


@SETTINGS
@given(**common)
def test_partial_rollout_resumes_every_interrupted_trajectory_with_all_its_tokens(
        seed, engines, group_size, prompts, steps):
    ctl, events, w = sim_run("partial_rollout", seed, engines, group_size, prompts, steps)
    check_nothing_lost(ctl, events, w)                     # lengths = the concatenation of every part
    for t in trained_trajectories(ctl).values():
        vs = list(t.versions)
        assert vs == sorted(vs), "tokens went back in version"
    published = [e.t for e in events if e.kind == "version_published" and e.version > 0]
    # every interrupt follows a publication and every interrupted request is admitted again (or the run ended)
    admitted = Counter(e.req_id for e in events if e.kind == "request_admitted")
    inter = Counter(e.req_id for e in events if e.kind == "trajectory_interrupted")
    for e in events:
        if e.kind == "trajectory_interrupted":
            assert published and min(published) <= e.t
    trained_reqs = {rid for g in ctl.v.groups.values() if g.consumed for rid in g.req_ids}
    for rid, n in inter.items():
        assert rid not in trained_reqs or admitted[rid] == n + 1


def test_partial_rollout_interrupts_and_mixes_versions_on_a_long_tail():
    mixed = inter = 0
    for seed in range(4):
        ctl, events, w = sim_run("partial_rollout", seed, 3, 4, 4, 5)
        inter += sum(1 for e in events if e.kind == "trajectory_interrupted")
        mixed += sum(1 for t in trained_trajectories(ctl).values() if len(set(t.versions)) > 1)
    assert inter > 0 and mixed > 0

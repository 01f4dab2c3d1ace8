"""The train leader's controller CPU (a CPU run's controller shares the leader's CPU with train rank 0): what
sim.calibrate's call_split measures of it and of the calls' own costs, and the simulated trainer it stretches."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sched.events import Event, EventLog
from sim import simulate
from sim.calibrate import call_split, measure
from sim.profiles import PROFILES, get_profile

CALL, PASS, TOK, OPT = 0.009, 0.037, 1e-5, 0.008   # s per call, per minibatch pass, per token, per optimizer step
FIRST = 0.006                                       # s more for a call's first pass than for its others
#                                                     (every call here comes after the trainer idled)
RATE, PER_TRAJ = 0.1, 2e-4                          # controller CPU: s/s background, s per trajectory handled


def _sync_like_run(path, rounds: int = 6, traj: int = 64, passes: int = 8):
    """A sync-shaped log: each round generates for a while (traj trajectories), then one call of `passes` passes
    and steps; the leader's CPU outside its trainer thread grows at RATE plus PER_TRAJ a trajectory."""
    path.mkdir()
    log = EventLog(path / "events.jsonl")
    t, cpu = 0.0, 0.0
    for i in range(rounds):
        gen = 0.5 + 0.1 * i
        for k in range(traj):
            log.write(Event("trajectory_finished", t + gen * (k + 1) / traj, rank=2, engine=0, req_id=i * traj + k))
        t += gen
        cpu += RATE * gen + PER_TRAJ * traj
        tokens = 300.0 + 100 * i
        passes_s = PASS * passes + TOK * tokens + FIRST
        first_pass_s = PASS + TOK * tokens / passes + FIRST
        span = CALL + passes_s + OPT * passes
        log.write(Event("train_started", t, rank=0, version=i))
        start_cpu = cpu
        t += span
        cpu += RATE * span
        log.write(Event("train_step_done", t, rank=0, version=i + 1,
                        data={"tokens": tokens, "samples": 16.0, "optimizer_steps": float(passes),
                              "step_time_s": span - 0.002, "passes_s": passes_s, "first_pass_s": first_pass_s,
                              "optimizer_s": OPT * passes,
                              "other_cpu_start_s": start_cpu, "other_cpu_s": cpu}))
    log.close()
    (path / "metrics.jsonl").write_text("".join(json.dumps({"tokens": 1, "step_time_s": 0.1}) + "\n"
                                                for _ in range(rounds)))


def test_the_split_recovers_the_calls_own_costs_and_the_controllers_cpu_per_trajectory(tmp_path):
    _sync_like_run(tmp_path / "run")
    m = measure(tmp_path / "run", train_ranks=2)
    assert m["split_calls"] == 6
    assert m["split_first_pass_extra_s"] == pytest.approx(FIRST, rel=1e-9)
    assert m["split_call_s"] == pytest.approx(CALL, rel=1e-9)
    assert m["split_pass_s"] == pytest.approx(PASS, rel=1e-9)
    assert m["split_s_per_token"] == pytest.approx(TOK, rel=1e-9)
    assert m["split_s_per_token_one_rank"] == pytest.approx(2 * TOK, rel=1e-9)
    assert m["controller_cpu_rate"] == pytest.approx(RATE, rel=1e-9)
    assert m["controller_handled"] == 5 * 64          # the first round's come before any call: not counted
    assert m["controller_s_per_trajectory"] == pytest.approx(PER_TRAJ, rel=1e-9)


def test_a_log_without_the_passes_gives_no_split():
    assert call_split([Event("train_started", 0.0), Event("train_step_done", 1.0, data={"tokens": 1.0})]) == {}


def test_every_paper_profile_charges_no_controller_cpu():
    assert all(p.controller_s_per_trajectory == 0.0 for p in PROFILES.values())


def _run(cost, preset: str = "one_step"):
    return simulate(preset, "cpu_tiny", cost, 2, 2, steps=6, group_size=4, prompts_per_step=8, seed=0)


@pytest.mark.parametrize("preset", ["one_step", "stream_generation"])
def test_each_trajectory_finishing_during_a_call_stretches_it_by_the_controllers_cpu(preset):
    c = 0.004
    cost = replace(get_profile("cpu_tiny"), controller_s_per_trajectory=c)
    r = _run(cost, preset)
    base = _run(get_profile("cpu_tiny"), preset)
    done = [e for e in r.events if e.kind == "train_step_done"]
    fin = [e.t for e in r.events if e.kind == "trajectory_finished"]
    stretched = 0
    for e in done:
        start = e.t - e.data["step_time_s"]
        n = sum(start - 1e-12 <= t <= e.t + 1e-12 for t in fin)
        extra = e.data["step_time_s"] - nominal(cost, e, r)
        k = round(extra / c)
        assert extra == pytest.approx(k * c, abs=1e-9) and 0 <= k <= n, (e, extra, n)
        stretched += k
    assert stretched > 0     # the policy overlaps generation with training: some call was stretched
    assert max(e.t for e in r.events) > max(e.t for e in base.events)
    # the calls still run one at a time, in order
    spans = sorted((e.t - e.data["step_time_s"], e.t) for e in done)
    assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))


def nominal(cost, e: Event, r) -> float:
    """The call's time without the controller: one optimizer step when it steps (minibatches = 1), its tokens
    (prompt + response, as sim/backend.py counts them)."""
    return cost.train_s(int(e.data["tokens"]), r.train_gpus, 1 if e.data["stepped"] else 0)


def test_colocated_mode_charges_no_controller_cpu():
    cost = replace(get_profile("cpu_tiny"), controller_s_per_trajectory=0.004)
    kw = dict(steps=4, group_size=4, prompts_per_step=8, seed=0, colocated=True)
    a = simulate("sync", "cpu_tiny", cost, 2, 2, **kw)
    b = simulate("sync", "cpu_tiny", get_profile("cpu_tiny"), 2, 2, **kw)
    assert [(e.kind, e.t) for e in a.events] == [(e.kind, e.t) for e in b.events]


def test_a_call_after_the_trainer_idled_pays_the_cold_start_and_one_right_behind_another_does_not():
    """slime's schedule: a round's calls issued back to back after the barrier; only the first finds the trainer
    idle. Each call's time against the same run without the term: +train_cold_s exactly for the round's first."""
    kw = dict(steps=6, group_size=4, prompts_per_step=8, seed=0)
    base = get_profile("cpu_tiny")
    plain = simulate("slime", "cpu_tiny", base, 1, 2, **kw)
    cold = simulate("slime", "cpu_tiny", replace(base, train_cold_s=0.05), 1, 2, **kw)
    a = [e.data["step_time_s"] for e in plain.events if e.kind == "train_step_done"]
    b = [e.data["step_time_s"] for e in cold.events if e.kind == "train_step_done"]
    extra = [round((y - x) / 0.05, 9) for x, y in zip(a, b)]
    assert len(a) == len(b) > 2 and set(extra) == {0.0, 1.0}
    starts = [e.t - e.data["step_time_s"] for e in cold.events if e.kind == "train_step_done"]
    ends = [e.t for e in cold.events if e.kind == "train_step_done"]
    pubs = sorted(e.t for e in cold.events if e.kind == "version_published")
    for i, x in enumerate(extra):   # cold exactly when the trainer was free (its last call and publication done)
        free = max([t for t in ends[:i]] + [t for t in pubs if i and t <= starts[i] + 1e-12], default=0.0)
        assert (x == 1.0) == (i == 0 or starts[i] > free + 1e-9), (i, x, starts[i], free)

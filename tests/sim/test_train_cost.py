"""The simulated trainer's fixed costs per optimizer step and per train call: sim.calibrate's fit of them from a run's
train calls, and the paper profiles' defaults (0) leaving every simulation as it was."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from sched.events import Event, EventLog
from sim import simulate
from sim.calibrate import measure, train_fit
from sim.profiles import PROFILES, get_profile

A, B, C = 6e-5, 0.035, 0.012      # s per token, per optimizer step, per call


def _write_run(path, calls: list[tuple[int, int, int, float]]) -> None:
    """A run directory whose train_step_done events carry (response tokens, samples, optimizer steps, seconds)."""
    path.mkdir()
    log = EventLog(path / "events.jsonl")
    for i, (tokens, samples, steps, secs) in enumerate(calls):
        log.write(Event("train_step_done", 1.0 + i, rank=0, version=i + 1,
                        data={"tokens": float(tokens), "samples": float(samples), "optimizer_steps": float(steps),
                              "step_time_s": secs}))
    log.close()
    with open(path / "metrics.jsonl", "w") as f:
        for tokens, samples, _, secs in calls:
            f.write(json.dumps({"tokens": tokens, "samples": samples, "step_time_s": secs}) + "\n")


def test_the_fit_recovers_known_per_token_per_step_and_per_call_costs_from_an_event_log(tmp_path):
    rng = random.Random(0)
    prompt = 4.0
    calls = []
    for _ in range(20):   # tokens and steps varied independently
        tokens, samples, steps = rng.randint(200, 3000), rng.choice([16, 64, 128]), rng.choice([0, 1, 2, 8])
        calls.append((tokens, samples, steps, A * (tokens + prompt * samples) + B * steps + C))
    _write_run(tmp_path / "run", calls)
    m = measure(tmp_path / "run", train_ranks=2, prompt_tokens=prompt)
    assert m["train_fit_calls"] == 20 and "train_fit_assumed" not in m
    assert m["train_fit_s_per_token"] == pytest.approx(A, rel=1e-6)
    assert m["train_fit_s_per_token_one_rank"] == pytest.approx(2 * A, rel=1e-6)
    assert m["train_step_s"] == pytest.approx(B, rel=1e-6)
    assert m["train_call_s"] == pytest.approx(C, rel=1e-6)
    assert m["train_fit_rms_s"] < 1e-9


def test_a_negative_term_is_clipped_at_zero_and_the_others_refitted():
    rng = random.Random(1)
    calls = []
    for _ in range(30):
        t, s = rng.randint(100, 2000), rng.choice([1, 2, 4, 8])
        calls.append((t, s, A * t + B * s - 0.004 + rng.gauss(0, 1e-4)))   # a negative fixed cost per call
    fit = train_fit(calls)
    assert fit["train_call_s"] == 0.0
    assert fit["train_fit_s_per_token"] > 0 and fit["train_step_s"] > 0
    free = train_fit([(t, s, y + 0.004) for t, s, y in calls])   # the same calls without it: c recovered
    assert free["train_call_s"] == pytest.approx(0.0, abs=1e-3)
    assert free["train_step_s"] == pytest.approx(B, rel=0.02)


def test_calls_of_one_step_count_attribute_their_fixed_time_to_the_steps():
    """A sync run's calls all take train.minibatches steps: per step and per call are one column; the fixed time
    goes to the steps and the fit says so."""
    calls = [(t, 8, A * t + 8 * B + C) for t in (900, 1500, 2300, 3100)]
    fit = train_fit(calls)
    assert fit["train_fit_s_per_token"] == pytest.approx(A, rel=1e-6)
    assert fit["train_step_s"] == pytest.approx(B + C / 8, rel=1e-6) and fit["train_call_s"] == 0.0
    assert "8 optimizer steps" in fit["train_fit_assumed"]


def test_every_paper_profile_charges_nothing_per_optimizer_step():
    assert all(p.train_step_s == 0.0 for p in PROFILES.values())


@pytest.mark.parametrize("preset", ["sync", "stream_generation", "slime"])
def test_a_paper_profile_simulation_is_unchanged_by_the_optimizer_steps_per_call(preset):
    kw = dict(num_engines=4, train_gpus=4, steps=10**9, group_size=8, prompts_per_step=16, seed=0, samples=2 * 16 * 8)
    base = simulate(preset, "rollpacker_7b_8k", "h800_7b", **kw)
    many = simulate(preset, "rollpacker_7b_8k", "h800_7b", minibatches=8, **kw)
    assert [(e.kind, e.t, e.data) for e in many.events] == [(e.kind, e.t, e.data) for e in base.events]


def test_each_stepping_call_pays_the_per_step_cost_for_each_of_its_minibatches():
    kw = dict(num_engines=1, train_gpus=3, steps=3, group_size=8, prompts_per_step=4, seed=0)
    base = get_profile("cpu_tiny")
    plain = simulate("sync", "cpu_tiny", base, **kw)
    step = simulate("sync", "cpu_tiny", replace(base, train_step_s=0.05, train_overhead_s=0.01), minibatches=4, **kw)
    durs = [e.data["step_time_s"] for e in plain.events if e.kind == "train_step_done"]
    more = [e.data["step_time_s"] for e in step.events if e.kind == "train_step_done"]
    assert len(durs) == len(more) == 3
    assert more == pytest.approx([d + 4 * 0.05 + 0.01 for d in durs], rel=1e-9)


def test_the_fit_measures_the_forward_passes_share_of_the_train_calls(tmp_path):
    """train_forward_share: the calls' forward seconds over their seconds, summed over the calls (what the
    decoupled-PPO proximal pass is charged at); a run whose calls do not report forward_s has none."""
    path = tmp_path / "run"
    path.mkdir()
    log = EventLog(path / "events.jsonl")
    for i, (fwd, secs) in enumerate([(0.05, 0.2), (0.1, 0.3)]):
        log.write(Event("train_step_done", 1.0 + i, rank=0, version=i + 1,
                        data={"tokens": 100.0, "samples": 8.0, "optimizer_steps": 8.0, "step_time_s": secs,
                              "forward_s": fwd}))
    log.close()
    (path / "metrics.jsonl").write_text("")
    assert measure(path, 2)["train_forward_share"] == pytest.approx(0.15 / 0.5, rel=1e-12)
    _write_run(tmp_path / "old", [(100, 8, 8, 0.2)])
    assert "train_forward_share" not in measure(tmp_path / "old", 2)


def test_every_paper_profile_charges_no_proximal_pass():
    assert all(p.proximal_share == 0.0 for p in PROFILES.values())


def test_decoupled_calls_of_several_steps_pay_the_proximal_pass_and_nothing_else_does():
    """proximal_pass (default: a preset with a staleness bound >= 1, train.py's decoupled-PPO default): a stepping
    call of several optimizer steps pays proximal_share x its train_s; one of one step, or a run without decoupled
    PPO, pays nothing extra."""
    kw = dict(num_engines=1, train_gpus=2, steps=3, group_size=8, prompts_per_step=4, seed=0)
    base = replace(get_profile("cpu_tiny"), train_step_s=0.02)
    prox = replace(base, proximal_share=0.25)

    def durs(preset, cost, **more):
        r = simulate(preset, "cpu_tiny", cost, **kw, **more)
        return [e.data["step_time_s"] for e in r.events if e.kind == "train_step_done"]

    assert durs("sync", prox, minibatches=4) == durs("sync", base, minibatches=4)          # on-policy: behaviour
    assert durs("one_step", prox, minibatches=1) == durs("one_step", base, minibatches=1)  # one step: none
    plain = durs("one_step", base, minibatches=4)
    assert durs("one_step", prox, minibatches=4) == pytest.approx([d * 1.25 for d in plain], rel=1e-9)
    assert durs("one_step", prox, minibatches=4, proximal_pass=False) == plain
    assert durs("sync", prox, minibatches=4, proximal_pass=True) == pytest.approx(
        [d * 1.25 for d in durs("sync", base, minibatches=4)], rel=1e-9)


def test_the_span_fit_recovers_the_decode_step_from_whole_busy_spans():
    """span_fit: each busy span's seconds against its tokens and steps (the reports' differences across the span),
    k3 per token and k4 per step; an interval-only fit would never see the spans' first, largest batches."""
    from sim.calibrate import span_fit
    k3, k4 = 2e-5, 4e-4
    events, t, total, steps = [], 0.0, 0, 0
    events.append(Event("tokens_decoded", t, rank=2, engine=0, data={"total": 0, "steps": 0}))
    for tokens, n in [(640, 20), (300, 90), (1200, 40), (90, 30)]:
        t += 0.5
        events.append(Event("engine_busy", t, rank=2, engine=0))
        mid = (total + tokens // 2, steps + n // 2)
        events.append(Event("tokens_decoded", t + 1e-4, rank=2, engine=0, data={"total": mid[0], "steps": mid[1]}))
        total, steps, t = total + tokens, steps + n, t + k3 * tokens + k4 * n
        events.append(Event("tokens_decoded", t, rank=2, engine=0, data={"total": total, "steps": steps}))
        events.append(Event("engine_idle", t, rank=2, engine=0))
    fit = span_fit(events)
    assert fit["span_k3"] == pytest.approx(k3, rel=1e-6) and fit["span_k4"] == pytest.approx(k4, rel=1e-6)
    assert fit["span_fit_spans"] == 4 and fit["span_fit_rms_s"] < 1e-9
    assert span_fit(events[:5]) == {}   # one span: nothing to fit


def test_the_fit_measures_the_optimizer_steps_own_seconds(tmp_path):
    path = tmp_path / "run"
    path.mkdir()
    log = EventLog(path / "events.jsonl")
    for i, (opt, n) in enumerate([(0.08, 8.0), (0.0, 0.0), (0.04, 8.0)]):
        log.write(Event("train_step_done", 1.0 + i, rank=0, version=i + 1,
                        data={"tokens": 100.0, "samples": 8.0, "optimizer_steps": n, "step_time_s": 0.3,
                              "optimizer_s": opt}))
    log.close()
    (path / "metrics.jsonl").write_text("")
    assert measure(path, 2)["optimizer_step_s"] == pytest.approx(0.12 / 16, rel=1e-12)


def test_every_paper_profile_charges_nothing_for_a_call_that_only_accumulates():
    assert all(p.train_accumulate_s == 0.0 for p in PROFILES.values())


def test_a_call_that_only_accumulates_pays_its_pass_and_a_stepping_one_does_not():
    c = replace(get_profile("cpu_tiny"), train_step_s=0.03, train_accumulate_s=0.02, train_overhead_s=0.001)
    assert c.train_s(1000, 2, 0) == pytest.approx(0.001 + 0.02 + 1000 * c.train_s_per_token / 2, rel=1e-12)
    assert c.train_s(1000, 2, 3) == pytest.approx(0.001 + 3 * 0.03 + 1000 * c.train_s_per_token / 2, rel=1e-12)

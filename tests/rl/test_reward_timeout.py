"""RollPacker §4.3: the adaptive reward timeout (rl/reward_timeout.py), the asynchronous scorer that applies it
at runtime (runtime/reward_scorer.py) and the simulator's reward path that applies it on the virtual clock."""
from __future__ import annotations

import threading
import time

import pytest

from rl.rewards import RewardResult
from runtime.reward_scorer import AsyncRewardScorer
from rl.reward_timeout import AdaptiveTimeout


def test_unseen_cases_fall_back_to_a_running_quantile_of_all_cases():
    t = AdaptiveTimeout(AdaptiveTimeout.Params(scale=1.5, min_s=0.1, max_s=30.0, fallback_quantile=0.5, min_obs=4,
                                               window=4))
    for i, x in enumerate([1.0, 2.0, 3.0]):
        t.observe(i, x, correct=True)
    assert t.timeout_s("new") == 30.0                 # too few observations: the paper's cap
    t.observe(3, 4.0, correct=True)
    t.observe(4, 99.0, correct=False)                 # wrong answers never count
    assert t.timeout_s("new") == pytest.approx(1.5 * 2.0)   # median of 1..4 (nearest rank) x scale
    assert t.timeout_s(0) == pytest.approx(1.5)       # a solved case keeps its own anchor
    for i in range(4):
        t.observe(10 + i, 8.0, correct=True)          # the window slides: the old fast runs leave it
    assert t.timeout_s("new") == pytest.approx(12.0)
    u = AdaptiveTimeout(t.p)
    u.load_state_dict(t.state_dict())
    assert u.timeout_s("new") == t.timeout_s("new") and u.timeout_s(0) == t.timeout_s(0)
    assert AdaptiveTimeout().timeout_s("new") == 30.0  # fallback off by default (the paper's rule)
    for bad in [dict(fallback_quantile=0.0), dict(fallback_quantile=1.5), dict(min_obs=0),
                dict(min_obs=10, window=5)]:
        with pytest.raises(ValueError):
            AdaptiveTimeout.Params(**bad)


def slow_reward(delays: dict[str, float], release: threading.Event | None = None):
    def fn(text: str, answer: str) -> RewardResult:
        if release is not None and text == "hang":
            release.wait(5)
        time.sleep(delays.get(text, 0.0))
        return RewardResult(float(text == answer), text == answer)
    return fn


def test_scorer_runs_beside_the_caller_and_returns_each_sample_once():
    scorer = AsyncRewardScorer(slow_reward({"a": 0.05, "b": 0.05}), workers=2)
    t0 = time.monotonic()
    scorer.submit(0, "tc0", "a", "a")
    scorer.submit(1, "tc1", "b", "a")
    assert time.monotonic() - t0 < 0.04               # submit never waits for the verifier
    out = scorer.drain()
    assert sorted(k for k, _, _ in out) == [0, 1] and len(scorer) == 0 and scorer.poll() == []
    got = {k: r for k, r, _ in out}
    assert got[0].correct and got[0].reward == 1.0 and not got[1].correct
    assert scorer.timeout.anchor == {"tc0": pytest.approx(0.05, abs=0.04)}   # only the correct run anchors
    scorer.close()


def test_scorer_kills_a_call_past_its_case_timeout_with_a_zero_reward():
    release = threading.Event()
    timeout = AdaptiveTimeout(AdaptiveTimeout.Params(scale=2.0, min_s=0.05, max_s=5.0))
    scorer = AsyncRewardScorer(slow_reward({"ok": 0.01}, release), workers=2, timeout=timeout)
    scorer.submit("warm", "tc", "ok", "ok")
    scorer.drain()
    assert timeout.timeout_s("tc") == pytest.approx(0.05, abs=0.04)   # learned: ~2 x 10 ms, floored at 50 ms
    scorer.submit("slow", "tc", "hang", "hang")       # would be correct, but far slower than the case allows
    t0 = time.monotonic()
    (key, result, took), = scorer.drain()
    release.set()
    assert key == "slow" and result.reward == 0.0 and not result.correct and result.failed   # counted failed
    assert "adaptive timeout" in result.reason and scorer.timed_out == 1
    assert time.monotonic() - t0 < 1.0                # not the 5 s the verifier would have taken
    assert timeout.timeout_s("tc") < 0.2              # a killed run never raises the anchor
    scorer.close()


def test_scorer_turns_a_crashing_verifier_into_a_failed_score():
    def boom(text, answer):
        raise ZeroDivisionError("bad verifier")
    scorer = AsyncRewardScorer(boom, workers=1)
    scorer.submit(7, "tc", "x", "y")
    (key, result, _), = scorer.drain()
    assert key == 7 and result.failed and "ZeroDivisionError" in result.reason
    scorer.close()


def test_scorer_reraises_a_malformed_result_and_close_never_waits_for_a_running_call():
    from rl.rewards import RewardError, get_reward_fn
    bad = get_reward_fn("exact")
    bad.fn = lambda text, answer: "1.0"               # a reward function that returns a string: a bug, not a fault
    scorer = AsyncRewardScorer(bad, workers=1)
    scorer.submit(0, "tc", "x", "x")
    with pytest.raises(RewardError, match="not a RewardResult"):
        scorer.drain()
    scorer.close()
    release = threading.Event()
    scorer = AsyncRewardScorer(slow_reward({}, release), workers=1)
    scorer.submit(1, "tc", "hang", "x")
    scorer.submit(2, "tc", "queued", "x")             # not started yet: cancelled by close
    jobs = list(scorer.jobs)
    t0 = time.monotonic()
    scorer.close()
    assert time.monotonic() - t0 < 0.5 and jobs[1].future.cancelled() and len(scorer) == 0
    release.set()


def test_reward_config_async_keys_and_the_rollout_ranks_scorer():
    from config import ConfigError, load_config
    from runtime.build import reward_scorer
    from runtime.reward_scorer import InlineScorer
    cfg = load_config("configs/tiny.toml", [])
    assert cfg.reward.async_workers == 0 and isinstance(reward_scorer(cfg, None), InlineScorer)   # default: inline
    cfg = load_config("configs/tiny.toml", ["--reward.async_workers=3", "--reward.timeout_s=4",
                                            "--reward.timeout_scale=2", "--reward.timeout_min_s=0.5"])
    scorer = reward_scorer(cfg, slow_reward({}))
    p = scorer.timeout.p
    assert scorer.pool._max_workers == 3 and (p.scale, p.min_s, p.max_s) == (2.0, 0.5, 4.0)
    scorer.close()
    with pytest.raises(ConfigError, match="reward.timeout_min_s = 2.0 .*<= reward.timeout_s = 1"):
        load_config("configs/tiny.toml", ["--reward.async_workers=1", "--reward.timeout_s=1"])
    with pytest.raises(ConfigError, match="reward.async_workers = -1"):
        load_config("configs/tiny.toml", ["--reward.async_workers=-1"])
    with pytest.raises(ConfigError, match="reward.timeout_scale = 0.5"):
        load_config("configs/tiny.toml", ["--reward.timeout_scale=0.5"])
    assert load_config("configs/tiny.toml", ["--reward.timeout_s=1"]).reward.timeout_s == 1  # inline: no floor


def test_simulated_reward_path_applies_the_adaptive_timeout():
    """RollPacker's code task (5% of sandbox runs hang until the fixed 30 s limit, and fail): with the adaptive
    timeout, runs past 1.5 x the slowest correct run of their (prompt, task) are cut there and scored 0, the pool
    spends less time scoring, and the steps get shorter; rule-checked math is never cut."""
    from dataclasses import replace

    from sim.profiles import MATH, MULTITASK_REWARD, get_profile
    from sim.cost import RewardLatency
    from sim.run import simulate
    code = next(t for t in MULTITASK_REWARD.tasks if t.sandbox)
    kw = dict(preset="rollpacker", workload="rollpacker_7b_8k", num_engines=4, train_gpus=4, steps=6, group_size=8,
              prompts_per_step=16, seed=0, reward_workers=8)
    coding = replace(get_profile("h800_7b"), reward=RewardLatency((code,)))
    fixed = simulate(cost=coding, **kw)
    adaptive = simulate(cost=coding, **kw, reward_timeout=AdaptiveTimeout())
    assert fixed.metrics["reward_killed"] == 0 and adaptive.metrics["reward_killed"] > 0
    assert adaptive.metrics["reward_busy_s"] < fixed.metrics["reward_busy_s"]
    assert adaptive.metrics["makespan_s"] < fixed.metrics["makespan_s"]
    killed = [e for e in adaptive.events if e.kind == "reward_scored" and not e.data["correct"]]
    assert len(killed) >= adaptive.metrics["reward_killed"] and all(e.data["task"] == "code" for e in killed)
    math_only = replace(get_profile("h800_7b"), reward=RewardLatency((MATH,)))
    assert simulate(cost=math_only, **kw, reward_timeout=AdaptiveTimeout()).metrics["reward_killed"] == 0


def test_simulated_reward_task_is_the_prompts_and_a_timed_out_run_fails():
    """One task per prompt (RollPacker's mix is per dataset); a run killed at its task's fixed limit scores 0."""
    from sim.run import simulate
    r = simulate("sync", "rollpacker_7b_8k", "h800_7b", 4, 4, steps=2, group_size=8, prompts_per_step=24, seed=1)
    tasks, hung = {}, 0
    for e in r.events:
        if e.kind == "reward_scored":
            tasks.setdefault(e.group_id, set()).add(e.data["task"])
            if e.data["task"] == "code" and e.data["latency_s"] >= 30.0 - 1e-9:
                hung += 1
                assert not e.data["correct"]
    assert all(len(t) == 1 for t in tasks.values()) and len(set.union(*tasks.values())) == 3
    assert hung > 0


def test_the_reward_stage_waits_for_the_round_and_the_pool_serves_in_order():
    """veRL's synchronous reward stage: no sample of a round is scored before the round's last one finished; with a
    pool of W scorers, never more than W calls at once."""
    from sim.run import simulate
    W = 3
    r = simulate("sync", "rollpacker_7b_8k", "h800_7b", 4, 4, steps=2, group_size=4, prompts_per_step=8, seed=0,
                 reward_workers=W, reward_stage=True)
    fin = {e.req_id: e.t for e in r.events if e.kind == "trajectory_finished"}
    rounds = {e.t: e.data["round"] for e in r.events if e.kind == "round_started"}
    starts = sorted(rounds)
    spans = []
    for e in r.events:
        if e.kind == "reward_scored":
            rnd = max(i for i, t in enumerate(starts) if t <= fin[e.req_id])
            last = max(t for rid, t in fin.items() if starts[rnd] <= t < (starts + [1e18])[rnd + 1])
            assert e.t - e.data["latency_s"] >= last - 1e-9
            spans.append((e.t - e.data["latency_s"], e.t))
    busiest = max(sum(a - 1e-6 <= t < b - 1e-6 for a, b in spans) for t, _ in spans)   # (floating point)
    assert busiest == W and any(e.data["wait_s"] > 0 for e in r.events if e.kind == "reward_scored")

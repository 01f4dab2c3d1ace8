"""The learned output-length ranker (StreamRL §5.2, sched/policies/streamrl/length_rank.py) ranks the long tail
first on prompts it has never seen, from their content, where the baselines cannot."""
from __future__ import annotations

import random

import pytest

from sched.policies.streamrl.dispatch import SkewnessDispatch
from sched.policies.streamrl.length_rank import PREDICTORS, HistoryPredictor, LearnedPredictor, PromptLengthPredictor
from tests.sched.test_policies_units import views


def workload(n: int, seed: int) -> list[tuple[int, list[int], int]]:
    """(prompt_index, prompt_ids, response length): every prompt 8 tokens long; one in five carries a 'hard'
    token (7) and answers in ~28 tokens, the others in ~3 (lognormal noise on both; no length signal)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        hard = rng.random() < 0.2
        ids = [rng.randrange(8, 40) for _ in range(8)]
        if hard:
            ids[rng.randrange(8)] = 7
        base = 28 if hard else 3
        out.append((seed * 100_000 + i, ids, max(1, round(base * rng.lognormvariate(0, 0.3)))))
    return out


def recall_at(pred, rows, frac: float = 0.2) -> float:
    """|predicted top frac ∩ true top frac| / |true top frac| (StreamRL Table 4's recall)."""
    k = int(len(rows) * frac)
    true_top = {r[0] for r in sorted(rows, key=lambda r: -r[2])[:k]}
    scored = sorted(rows, key=lambda r: -pred.predict(r[0], len(r[1]), r[1]))
    return len(true_top & {r[0] for r in scored[:k]}) / k


def train(pred, rows, samples: int = 4) -> None:
    rng = random.Random(1)
    for idx, ids, n in rows:
        for _ in range(samples):
            pred.observe(idx, len(ids), max(1, n + rng.randint(-1, 1)), ids)


def test_learned_ranks_unseen_long_tail_prompts_far_better_than_chance_and_the_baselines():
    seen, unseen = workload(300, seed=1), workload(200, seed=2)
    learned, history, plen = LearnedPredictor(), HistoryPredictor(), PromptLengthPredictor()
    for p in (learned, history, plen):
        train(p, seen)
    r = recall_at(learned, unseen)
    assert r >= 0.8, r                                        # chance is 0.2
    assert recall_at(history, unseen) < 0.5 and recall_at(plen, unseen) < 0.5   # no signal for them here


def test_learned_uses_a_prompts_own_history_and_starts_as_prompt_length():
    p = LearnedPredictor()
    assert p.predict(0, 5) == 5.0 and p.predict(1, 9) == 9.0     # nothing observed: prompt length
    ids = [9, 9, 9]
    for _ in range(20):                                          # identical prompts, different histories
        p.observe(0, 3, 30, ids)
        p.observe(1, 3, 2, ids)
    assert p.predict(0, 3, ids) > 3 * p.predict(1, 3, ids)


def test_learned_forgets_old_lengths_as_the_policy_drifts():
    p = LearnedPredictor(LearnedPredictor.Params(forget=0.9))
    for _ in range(50):
        p.observe(0, 4, 2, [5, 6])
    for _ in range(50):
        p.observe(1, 4, 40, [5, 6])                              # same content, now long
    assert p.predict(2, 4, [5, 6]) > 20


def test_state_round_trip_and_params():
    p = LearnedPredictor()
    train(p, workload(50, seed=3))
    q = LearnedPredictor()
    q.load_state_dict(p.state_dict())
    for idx, ids, _ in workload(20, seed=4):
        assert q.predict(idx, len(ids), ids) == pytest.approx(p.predict(idx, len(ids), ids))
    with pytest.raises(ValueError, match="features"):
        LearnedPredictor(LearnedPredictor.Params(buckets=8)).load_state_dict(p.state_dict())
    for bad in [dict(buckets=0), dict(ridge=0), dict(forget=0), dict(forget=1.5), dict(max_tokens=0)]:
        with pytest.raises(ValueError):
            LearnedPredictor.Params(**bad)


def test_skewness_dispatch_selects_the_learned_ranker_and_feeds_it_prompt_tokens():
    assert "learned" in PREDICTORS
    d = SkewnessDispatch(SkewnessDispatch.Params(predictor="learned", long_fraction=0.5, long_engines=1))
    assert isinstance(d.ranker, LearnedPredictor)
    v = views([["pending"] * 2] * 2, engines=2)
    for g in v.groups.values():                                  # group 1's prompt carries the 'hard' token
        g.prompt.prompt_ids = [7, 8] if g.group_id == 1 else [9, 8]
    for i in range(30):
        d.ranker.observe(100 + i, 2, 30, [7, 8])
        d.ranker.observe(200 + i, 2, 2, [9, 8])
    subs = {s.engine: s.req_ids for s in d.admit(v)}
    assert d.long == {1} and subs[1] == v.groups[1].req_ids     # the predicted-long group on the long engine
    first = v.requests[v.groups[0].req_ids[0]]
    v.requests.set_state(first, "finished")
    first.tokens = 3
    v.finishes.setdefault(0, []).append(first.req_id)          # as the lifecycle records a trajectory_finished
    d.admit(v)
    assert d.ranker.history[v.groups[0].prompt_index] == [pytest.approx(1.386, abs=1e-3), 1]  # log1p(3), seen once

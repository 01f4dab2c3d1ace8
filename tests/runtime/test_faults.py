"""Isolated faults (a reward function that raises, a prompt the tokenizer rejects, a request whose logits go
non-finite) are marked failed and counted, and the run goes on. A rank that stalls, freezes or dies ends the job
with a named report: tests/runtime/test_fault_matrix.py; the deadline rules themselves:
tests/runtime/test_watchdog.py."""
import itertools
import math
from pathlib import Path

import pytest
import torch

from engine.sampler import ERROR_TOKEN, Sampler
from engine.sampling import SamplingParams
from rl.data import DataError, PromptDataset
from rl.rewards import CheckedReward, RewardError, RewardResult
from rl.types import Group
from runtime.messages import Start, StartRequest
from sched.decisions import LoadWeights
from sched.metrics import rollout_stats

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------ isolated faults


def flaky_reward(text: str, answer: str) -> RewardResult:
    if "b" in text:
        raise ZeroDivisionError("the scorer broke on this one")
    return RewardResult(1.0 if text == answer else 0.0, text == answer)


def test_a_reward_function_that_raises_scores_zero_marked_failed():
    fn = CheckedReward("custom", flaky_reward)
    assert fn("a", "a") == RewardResult(1.0, True)
    bad = fn("ab", "ab")
    assert (bad.reward, bad.correct, bad.failed) == (0.0, False, True)
    assert "ZeroDivisionError" in bad.reason and "custom" in bad.reason
    with pytest.raises(RewardError, match="non-numeric"):  # a wrong return type is a bug: still fatal
        CheckedReward("custom", lambda t, a: RewardResult("1", True))("a", "a")


def test_the_rollout_worker_goes_on_through_a_raising_reward_and_counts_it():
    from tests.support.worker import make_worker, published
    w, ch, task, tok = make_worker(max_new_tokens=3)
    calls = itertools.count()  # every other call raises: the outcome does not hang on what was sampled
    w.scorer.fn = CheckedReward("custom", lambda text, answer: 1 // 0 if next(calls) % 2 else RewardResult(0.5, False))
    w.relay.fill(published(w.engine), 0)
    w.handle(LoadWeights(0, 0))
    p, a = task.prompts()[0]
    w.handle(Start([StartRequest(i, 0, i, 0, tok.encode(p, add_special_tokens=False), a) for i in range(8)]))
    while w.engine.has_unfinished():
        w.step()
    scored = [e for _, batch in ch.sent for e in batch if e.kind == "reward_scored"]
    assert len(scored) == 8
    failed = [e for e in scored if e.data["failed"]]
    assert len(failed) == 4
    assert all(e.data["reward"] == 0.0 and e.payload.meta["reward_failed"] for e in failed)
    group = Group(0, 0, a, [e.payload for e in scored])
    assert rollout_stats([group])["reward_failed"] == len(failed)


class PickyTokenizer:
    """Raises on prompts with a '!', encodes '~' prompts to nothing, one token per character otherwise."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        if "!" in text:
            raise ValueError("unsupported character '!'")
        return {"input_ids": [] if text.startswith("~") else [ord(c) % 50 for c in text]}


def test_prompts_the_tokenizer_rejects_are_skipped_and_counted():
    rows = [{"prompt": t, "answer": "x"} for t in ("abc", "no!", "~", "de", "x" * 40)]
    ds = PromptDataset.from_records(enumerate(rows, 1), PickyTokenizer(), max_prompt_tokens=16)
    assert [p.index for p in ds] == [0, 3]
    assert ds.skipped_rejected == [1, 2] and ds.skipped_too_long == [4]
    with pytest.raises(DataError, match=r"all 2 prompts skipped: 2 rejected by the tokenizer \(first: <memory>:1: "
                                        r"ValueError: unsupported character"):
        PromptDataset.from_records(enumerate(rows[1:3], 1), PickyTokenizer(), max_prompt_tokens=16)


def test_the_sampler_gives_no_token_for_non_finite_logits():
    logits = torch.randn(4, 7)
    logits[0, 3] = float("nan")
    logits[1, 2] = float("inf")
    logits[2, :] = float("-inf")
    for params in (SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0)):
        tokens, lps, _ = Sampler(torch.device("cpu"))(logits, [params] * 4, [0] * 4)
        assert tokens[:3] == [ERROR_TOKEN] * 3 and all(math.isnan(x) for x in lps[:3])
        assert 0 <= tokens[3] < 7 and math.isfinite(lps[3])


def test_a_request_whose_logits_go_non_finite_is_dropped_and_the_rest_go_on():
    from tests.support.worker import make_worker, published
    w, ch, task, tok = make_worker(max_new_tokens=4)
    w.relay.fill(published(w.engine), 0)
    w.handle(LoadWeights(0, 0))
    run = w.engine.runner.run

    def poisoned(batch):  # request 1's logits go NaN once it has one token
        logits = run(batch).clone()
        for seq, row in zip(batch.sample_seqs, batch.sample_rows):
            if seq.request_id == 1 and seq.num_generated >= 1:
                logits[row] = float("nan")
        return logits
    w.engine.runner.run = poisoned
    p, a = task.prompts()[0]
    w.handle(Start([StartRequest(i, 0, i, 0, tok.encode(p, add_special_tokens=False), a) for i in range(3)]))
    while w.engine.has_unfinished():
        w.step()
    events = [e for _, batch in ch.sent for e in batch]
    assert sorted(e.req_id for e in events if e.kind == "reward_scored") == [0, 2]
    err = [e for e in events if e.kind == "trajectory_aborted"]
    assert [(e.req_id, e.data["requeue"], e.data["error"], e.data["tokens"]) for e in err] == \
        [(1, False, "non-finite logits", 1)]
    assert all(tok_id >= 0 for e in events if e.kind == "reward_scored" for tok_id in e.payload.response_ids)
    assert w.engine.block_manager.num_free == w.engine.block_manager.num_blocks  # its KV blocks came back
    from runtime.rundir import fault_counts
    assert fault_counts(events) == {"reward_failed": 0, "sample_errors": 1}

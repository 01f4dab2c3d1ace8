"""rl/tasks.py: deterministic synthetic prompts, the rules, the partial-credit scorer."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.rewards import get_reward_fn
from rl.tasks import TASK_NAMES, SyntheticTask, score_positions


@pytest.mark.parametrize("name", TASK_NAMES)
def test_deterministic_from_seed(name):
    a = SyntheticTask(name, num_prompts=50, seed=3).prompts()
    assert a == SyntheticTask(name, num_prompts=50, seed=3).prompts()
    assert a != SyntheticTask(name, num_prompts=50, seed=4).prompts()
    assert len(a) == 50


def test_rules():
    for name, expect in [("first", "c"), ("last", "d"), ("copy", "cafd"), ("reverse", "dfac")]:
        task = SyntheticTask(name, num_prompts=200, seed=0, alphabet="abcdf", min_len=4, max_len=4)
        for prompt, answer in task.prompts():
            assert prompt.endswith("=") and len(prompt) == 5
            s = prompt[:-1]
            assert answer == {"first": s[0], "last": s[-1], "copy": s, "reverse": s[::-1]}[name]
        assert task.score(expect, expect).correct


def test_lengths_and_alphabet_respected():
    task = SyntheticTask("copy", num_prompts=300, seed=1, alphabet="xyz", min_len=2, max_len=5)
    lengths = {len(a) for _, a in task.prompts()}
    assert lengths == {2, 3, 4, 5}
    assert all(set(a) <= set("xyz") for _, a in task.prompts())
    assert task.max_response_tokens == 6


def test_unknown_task_and_bad_options():
    with pytest.raises(ValueError, match="valid tasks: first, last, copy, reverse"):
        SyntheticTask("sort")
    for kwargs in [dict(min_len=0), dict(min_len=3, max_len=2), dict(num_prompts=0), dict(alphabet="aab"),
                   dict(sep="a"), dict(sep="==")]:
        with pytest.raises(ValueError):
            SyntheticTask("copy", **kwargs)


def test_tokenizer_covers_prompts(tmp_path):
    task = SyntheticTask("reverse", num_prompts=20)
    tok = task.tokenizer(tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    for prompt, answer in task.prompts():
        ids = tok(prompt)["input_ids"]
        assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == prompt
        assert tok.unk_token_id not in tok(answer)["input_ids"]


@pytest.mark.parametrize("response, answer, reward, correct", [
    ("dcba", "dcba", 1.0, True),        # perfect
    (" dcba\n", "dcba", 1.0, True),     # surrounding whitespace ignored
    ("dcbx", "dcba", 0.75, False),      # one position wrong
    ("dc", "dcba", 0.5, False),         # stopped early
    ("dcbaaaaa", "dcba", 0.5, False),   # rambled past the answer
    ("", "dcba", 0.0, False),           # empty
    ("zzzz", "dcba", 0.0, False),       # garbage
    ("<pad><eos>", "a", 0.0, False),    # special tokens left in the text are just wrong characters
])
def test_score(response, answer, reward, correct):
    r = SyntheticTask("reverse").score(response, answer)
    assert r.reward == pytest.approx(reward) and r.correct is correct and not r.failed and r.reason


def test_registry_returns_task_scorer():
    assert get_reward_fn("synthetic").fn is score_positions


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abc =", max_size=8), st.text(alphabet="abc", min_size=1, max_size=6))
def test_score_bounds(response, answer):
    r = score_positions(response, answer)
    assert 0.0 <= r.reward <= 1.0
    assert (r.reward == 1.0) == r.correct == (response.strip() == answer)

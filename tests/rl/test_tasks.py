"""rl/tasks.py: deterministic synthetic prompts, the rules, the partial-credit scorer."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.rewards import get_reward_fn
from rl.data import PromptDataset
from rl.tasks import TASK_NAMES, LengthDist, SyntheticTask, score_positions


@pytest.mark.parametrize("name", TASK_NAMES)
def test_deterministic_from_seed(name):
    a = SyntheticTask(name, num_prompts=50, seed=3).prompts()
    assert a == SyntheticTask(name, num_prompts=50, seed=3).prompts()
    assert a != SyntheticTask(name, num_prompts=50, seed=4).prompts()
    assert len(a) == 50


@pytest.mark.parametrize("name", TASK_NAMES)
def test_vocab_size_and_eos_are_the_tokenizers_without_building_it(name):
    """A train rank sizes the tiny model from these (runtime/build.py) and builds no tokenizer: they must agree."""
    task = SyntheticTask(name, num_prompts=4, seed=0)
    tok = task.tokenizer()
    assert (task.vocab_size, task.eos_token_id) == (len(tok), tok.eos_token_id)
    assert set(task.chars) >= {c for prompt, answer in task.prompts() for c in prompt + answer}


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


def test_unknown_task_and_bad_options():
    with pytest.raises(ValueError, match="valid tasks: first, last, copy, reverse, repeat, calc"):
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


# ---- the long-tail length workload ---------------------------------------------------------------------------
def test_repeat_prompts_state_the_length_and_the_tail_is_heavy():
    task = SyntheticTask("repeat", num_prompts=4000, seed=0)
    pairs = task.prompts()
    for prompt, answer in pairs[:200]:
        sym, n = prompt[0], int(prompt[1:-1])
        assert prompt.endswith("=") and answer == sym * n and sym in task.alphabet
    lengths = [len(a) for _, a in pairs]
    assert set(lengths) <= set(range(1, 5)) | set(range(24, 33)) and max(lengths) == 32
    tail = [n for n in lengths if n >= 24]
    assert 0.10 < len(tail) / len(lengths) < 0.15                 # 1 prompt in 8 ...
    assert sum(tail) / sum(lengths) > 0.5                          # ... carries most of the tokens


def test_length_dist_bounds_and_errors():
    import random
    d = LengthDist(body_max=2, tail_min=10, tail_max=12, tail_frac=0.5)
    draws = [d.draw(random.Random(i)) for i in range(500)]
    assert set(draws) == {1, 2, 10, 11, 12}
    for bad in [dict(body_max=0), dict(body_max=30), dict(tail_min=40), dict(tail_frac=1.5)]:
        with pytest.raises(ValueError):
            LengthDist(**bad)
    with pytest.raises(ValueError, match="digits"):
        SyntheticTask("repeat", alphabet="ab1")


def test_capped_dataset_stops_each_response_at_its_answer(tmp_path):
    task = SyntheticTask("repeat", num_prompts=64, seed=2)
    tok = task.tokenizer(tmp_path / "tok")
    ds = PromptDataset.from_synthetic(task, tok, 16, cap_at_answer=True)
    for p in ds:
        assert p.max_new_tokens == len(p.answer) + 1                 # the answer and its EOS
        assert tok.unk_token_id not in p.prompt_ids and tok.decode(p.prompt_ids, skip_special_tokens=True) == p.prompt
    assert all(p.max_new_tokens is None for p in PromptDataset.from_synthetic(task, tok, 16))


def test_repeat_reward_measures_the_symbol_and_the_stop():
    task = SyntheticTask("repeat")
    assert task.score("cccc", "cccc").correct
    assert task.score("cccd", "cccc").reward == pytest.approx(0.75)
    assert task.score("ccccc", "cccc").reward == pytest.approx(0.8)  # ran to the cap without stopping
    assert task.score("c", "cccc").reward == pytest.approx(0.25)     # stopped early


def test_build_run_wires_the_workload_keys():
    from config import load_config
    from runtime.build import build_run
    cfg = load_config("configs/tiny.toml", ["--data.task=repeat", "--data.cap_at_answer=true",
                                            "--data.len_tail_frac=1.0", "--data.len_tail_min=6",
                                            "--data.len_tail_max=7", "--rollout.max_new_tokens=8"])
    items = build_run(cfg, with_data=True).source(40)
    assert {len(i.answer) for i in items} == {6, 7}
    assert all(i.max_new_tokens == len(i.answer) + 1 for i in items)


def test_calc_prompts_are_solved_by_one_call_and_not_guessable():
    """Every `calc` product is solved exactly by a first turn "=" (the calculator on the prompt's line) and a second
    turn copying the result; a worked example shows that transcript. The answers are spread over hundreds of values
    (no constant answer scores much), and the tokenizer covers every prompt and observation."""
    from rl.episode import next_call, observation_ids
    from rl.tools import calculator_env
    from runtime.samples import response_decoder
    task = SyntheticTask("calc", num_prompts=400, seed=0)
    tok = task.tokenizer()
    env = calculator_env("plain", max_turns=2)
    decode = response_decoder(tok, frozenset({tok.eos_token_id}))
    eq = tok("=", add_special_tokens=False)["input_ids"]
    pairs = task.prompts()
    products = [(p, a) for p, a in pairs if "=" not in p]
    examples = [(p, a) for p, a in pairs if "=" in p]
    assert 0.4 < len(examples) / len(pairs) < 0.6
    for p, a in products:
        assert p.count("*") == 1 and len(a) == 3 and int(a) == eval(p)   # noqa: S307 (test data only)
        assert p[0] == "(" and p[-1] == ")"    # "=" follows ")" in a correct episode, never a digit
        ids = tok(p)["input_ids"]
        assert tok.unk_token_id not in ids
        obs = env.run(next_call(env, decode, ids, eq, [1]))
        assert obs.text == a and not obs.failed
        transcript = tok.decode(ids + eq + observation_ids(tok, env, obs), skip_special_tokens=True)
        assert transcript == f"{p}={a}|"
    for p, a in examples:
        assert p == f"{p.split('=')[0]}={a}|" and tok.unk_token_id not in tok(p)["input_ids"]
    assert len({a for _, a in products}) > 120
    best_constant = max(sum(score_positions(c, a).reward for _, a in products) for c in ("111", "222", "333", "123"))
    assert best_constant / len(products) < 0.25


def test_calc_responses_stop_at_exactly_a_correct_episode():
    """Under cap_at_answer a product's cap is its call, observation and answer when episodes may call a tool (the
    answer alone when not), a worked example's its answer: a correct episode fills it, and no EOS is needed."""
    from rl.episode import observation_ids
    from rl.env import Observation
    from rl.tools import calculator_env
    env = calculator_env("plain", max_turns=2)
    for tools in (True, False):
        task = SyntheticTask("calc", num_prompts=60, seed=1, tools=tools)
        tok = task.tokenizer()
        ds = PromptDataset.from_synthetic(task, tok, 16, cap_at_answer=True)
        assert {"=" in p.prompt for p in ds} == {True, False}
        for p in ds:
            answer = tok(p.answer, add_special_tokens=False)["input_ids"]
            if "=" in p.prompt or not tools:
                assert p.max_new_tokens == len(answer) == 3
                continue
            episode = (tok("=", add_special_tokens=False)["input_ids"]
                       + observation_ids(tok, env, Observation(p.answer)) + answer)
            assert p.max_new_tokens == len(episode) == 8
    assert SyntheticTask("reverse").response_cap("abc=", "cba") == 4   # other tasks: the answer and its EOS

"""rl/rewards.py: answer extraction, math equivalence through math_verify in worker processes with our own
deadline, exact match, and the registry."""
from __future__ import annotations

import statistics
import threading
import time

import pytest

from rl import rewards
from rl.rewards import (ExactReward, MathReward, RewardResult, VerifierPool, extract_answer, get_reward_fn,
                        last_boxed)


def _hang(response: str, answer: str):  # runs in the worker (pickled by reference)
    time.sleep(60)


def _boom(response: str, answer: str):
    raise ArithmeticError("verifier exploded")


@pytest.fixture(scope="module")
def pool():
    p = VerifierPool(size=1)
    yield p
    p.close()


@pytest.fixture(scope="module")
def math(pool):
    return MathReward(timeout_s=20.0, pool=pool)  # generous: the machine is shared; hangs are tested separately


@pytest.mark.parametrize("text, expect", [
    (r"so \boxed{\sqrt{\frac{1}{2}}} done", r"\sqrt{\frac{1}{2}}"),
    (r"\boxed{1} then \boxed{ {2} }", "{2}"),
    (r"\fbox{7}", "7"),
    (r"\boxed{unclosed", None),
    ("", None),
])
def test_last_boxed(text, expect):
    assert (last_boxed(text).strip() if last_boxed(text) is not None else None) == expect


@pytest.mark.parametrize("text, expect", [
    (r"first \boxed{3} and finally \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    ("The answer is $-3$.", "-3"),
    ("Final answer: 12", "12"),
    ("work\n#### 1,234\n", "1,234"),
    ("I got 3 apples, then 5.5 more", "5.5"),
    ("no digits here", None),
])
def test_extract_answer(text, expect):
    assert extract_answer(text) == expect


@pytest.mark.parametrize("response, answer", [
    (r"Thus \boxed{\frac{3}{4}}.", "0.75"),
    (r"\boxed{0.75}", r"\frac{3}{4}"),
    # Percentages follow math_verify: 50\% matches both the fraction and the bare number.
    (r"\boxed{50\%}", "0.5"),
    (r"\boxed{50\%}", "50"),
    (r"\boxed{5\text{ cm}}", "5"),        # units dropped
    (r"\boxed{\sqrt{\frac{1}{2}}}", r"\frac{\sqrt{2}}{2}"),  # nested braces, symbolic equality
    ("Adding up: 40 + 2\n#### 42", "42"),
    ("The answer is -7.", "-7"),
    (r"\boxed{-\frac{1}{3}}", "-1/3"),
    ("so she has 18 dollars left", "18"),
    (r"\boxed{1,000}", "1000"),
])
def test_math_correct(math, response, answer):
    r = math(response, answer)
    assert r == RewardResult(1.0, True, False, r.reason), r


@pytest.mark.parametrize("response, answer", [
    (r"\boxed{\frac{3}{5}}", "0.75"),
    (r"\boxed{-42}", "42"),
    ("#### 41", "42"),
    (r"\boxed{5\text{ cm}}", "6"),
    ("I do not know", "3"),
])
def test_math_wrong(math, response, answer):
    r = math(response, answer)
    assert r.reward == 0.0 and not r.correct and not r.failed and r.reason


def test_pathological_input_times_out(pool):
    slow = MathReward(timeout_s=1.0, pool=pool)
    t = time.perf_counter()
    r = slow(r"\boxed{9^{9^{9^{9}}}}", "1")  # sympy would try to build a number with ~10^8 digits
    assert r.failed and r.reward == 0.0 and "timeout" in r.reason
    assert time.perf_counter() - t < 10


def test_hanging_verifier_hits_our_timeout(pool, math, monkeypatch):
    monkeypatch.setattr(rewards, "score_math", _hang)
    t = time.perf_counter()
    r = MathReward(timeout_s=0.5, pool=pool)(r"\boxed{1}", "1")
    assert time.perf_counter() - t < 5
    assert r.failed and r.reward == 0.0 and not r.correct and "timeout" in r.reason
    monkeypatch.undo()
    assert math(r"\boxed{1}", "1").correct  # the killed worker was replaced


def test_raising_verifier_is_a_failure_not_a_crash(pool, math, monkeypatch):
    monkeypatch.setattr(rewards, "score_math", _boom)
    r = math(r"\boxed{1}", "1")
    assert r.failed and r.reward == 0.0 and "verifier exploded" in r.reason
    monkeypatch.undo()
    assert math(r"\boxed{2}", "2").correct


def test_works_from_other_threads(math):
    results: list[RewardResult] = []
    threads = [threading.Thread(target=lambda i=i: results.append(math(rf"\boxed{{{i}/4}}", str(i / 4))))
               for i in range(1, 5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert len(results) == 4 and all(r.correct for r in results), results


def test_workers_are_reused_and_calls_are_cheap(pool, math):
    math(r"\boxed{42}", "42")  # warm
    pids = {p.proc.pid for p in pool._all}
    times = []
    for _ in range(20):
        t = time.perf_counter()
        assert math(r"\boxed{42}", "42").correct
        times.append(time.perf_counter() - t)
    assert {p.proc.pid for p in pool._all} == pids  # no new process per call
    assert statistics.median(times) < 0.1, times  # typically ~3 ms; lenient for a shared machine


def test_exact_match():
    exact = ExactReward()
    assert exact("  hello   world\n", "hello world").correct
    assert not exact("Hello world", "hello world").correct
    assert ExactReward(casefold=True)("Hello World", "hello world").reward == 1.0
    assert exact("", "x") == RewardResult(0.0, False, False, "mismatch")


def test_registry():
    assert isinstance(get_reward_fn("math", timeout_s=2.0).fn, MathReward)
    assert get_reward_fn("exact", casefold=True).casefold
    with pytest.raises(ValueError, match="valid kinds: math, exact, synthetic"):
        get_reward_fn("bleu")


@pytest.mark.parametrize("response, reference", [
    (r"so \boxed{72}", "She sells 48 + 24 = <<48+24=72>>72 clips.\n#### 72"),  # GSM8K: what follows ####
    (r"\boxed{0.5}", r"The probability is $\boxed{\frac{1}{2}}$, since ..."),  # MATH: its last \boxed{}
])
def test_math_reads_worked_solutions_as_references(math, response, reference):
    from rl.rewards import reference_answer
    assert reference_answer("#### 72") == "72" and reference_answer("42") == "42"
    assert math(response, reference).correct
    assert not math(r"\boxed{71}", reference).correct

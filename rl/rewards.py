"""Verifiable rewards: `(response_text, answer) -> RewardResult`.

- `math`: extract the final answer (the last `\\boxed{...}`, braces nested; else "answer is X" or "#### X"; else the
  last number) and check it against the reference with `math_verify`. A reference may be a whole worked solution:
  its last `\\boxed{}` (MATH) or what follows `####` (GSM8K) is the answer. Percentages follow math_verify: `50\\%`
  matches both "50" and "0.5". Units in `\\text{...}` are dropped: `5\\text{ cm}` matches "5".
- `exact`: whitespace-normalised string equality, optionally case-folded.
- `synthetic`: the partial-credit scorer of `rl.tasks`.

math_verify's own timeouts use SIGALRM, which only works in the main thread, so they are switched off and the whole
math scoring (extraction included) runs in a small pool of reusable worker processes under our own deadline. A
verifier that hangs, raises or kills its process gives `failed=True`, reward 0 and a reason; the worker is replaced
and the caller, in whatever thread it runs, carries on. The pipe round trip to a warm worker costs ~0.05 ms; a
typical scoring call 0.2-1 ms (sympy), measured on an idle core.

`get_reward_fn` wraps every kind in `CheckedReward`: a result that is not a `RewardResult` with a finite real
`reward` raises `RewardError` naming the kind, rather than reaching the advantages as a string, None or NaN (a
reward function that returns the wrong type is a bug to fix, so the run stops). A reward function that *raises*
while scoring one response is that response's fault or a passing one: it scores 0 with `failed=True` and the
exception as its reason, and the run goes on (the runtime counts failed scores: `reward_failed` per step in
metrics.jsonl and in summary.json).

Model output is never evaluated as code: extraction is regular expressions, and math_verify parses LaTeX with its
ANTLR grammar into sympy objects; its plain-expression fallback hands sympy's `parse_expr` (which does `eval`) only
text its regex admits: digits, `.`, whitespace and the operators `+ - * / ^ ( ) × ÷`, so no names or attributes.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import numbers
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from rl.types import RewardResult


RewardFn = Callable[[str, str], RewardResult]

# ---- answer extraction (runs in the worker; linear-time patterns only) ---------------------------------------------
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*([^\n]+)", re.IGNORECASE)
_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included; None if there is none or it
    is never closed."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer in a response, or None when nothing looks like one."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_ANSWER_IS, _HASHES):
        found = pattern.findall(text)
        if found:
            ans = found[-1].strip().rstrip(".").strip().strip("$").strip()
            if ans:
                return ans
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def reference_answer(reference: str) -> str:
    """The final answer of a reference: the content of its last `\\boxed{...}` (a MATH solution), else what follows
    its last `####` (a GSM8K solution), else the reference as it is."""
    boxed = last_boxed(reference)
    if boxed is not None:
        return boxed.strip()
    if "####" in reference:
        return reference.rsplit("####", 1)[1].strip()
    return reference


def _as_latex(ans: str) -> str:
    """Wrap a bare answer so math_verify's boxed extraction (highest priority, unit normalisation) takes it whole."""
    return ans if ("\\boxed" in ans or "$" in ans) else f"\\boxed{{{ans}}}"


def score_math(response: str, answer: str) -> tuple[float, bool, str]:
    """Extract and verify; the function the worker runs. Returns (reward, correct, reason)."""
    from math_verify import parse, verify  # imported in the worker only
    answer = reference_answer(answer)
    pred = extract_answer(response)
    if pred is None:
        return 0.0, False, "no answer found"
    gold_parsed = parse(_as_latex(answer), parsing_timeout=None)
    pred_parsed = parse(_as_latex(pred), parsing_timeout=None)
    if not gold_parsed:  # a reference math_verify cannot read: fall back to string equality
        ok = _normalise(pred) == _normalise(answer)
        return float(ok), ok, f"reference unparseable; string match={ok}"
    if not pred_parsed:
        return 0.0, False, f"answer {pred[:80]!r} unparseable"
    ok = bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    return float(ok), ok, f"answer {pred[:80]!r} {'matches' if ok else 'differs'}"


# ---- worker pool ---------------------------------------------------------------------------------------------------
# Workers are fresh interpreters started with subprocess, not multiprocessing: no fork of a threaded (torch,
# torch.distributed) parent, and no re-execution of the caller's unguarded `__main__` as spawn would do.
def _worker_main(read_fd: int, write_fd: int) -> None:
    """Worker loop: receive (fn, args), send ("ok", result) or ("error", message); exit when the parent goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings: we know
    score_math(r"\boxed{\frac{1}{2}}", "0.5")  # pay the imports (sympy loads lazily) before taking deadlines
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    outbox.send("ready")
    while True:
        try:
            fn, args = inbox.recv()
        except (EOFError, OSError):
            return
        try:
            outbox.send(("ok", fn(*args)))
        except BaseException as e:  # noqa: BLE001 - report anything, keep serving
            outbox.send(("error", f"{type(e).__name__}: {e}"[:500]))


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


class _Worker:
    def __init__(self, startup_timeout_s: float):
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = f"from rl.rewards import _worker_main; _worker_main({from_parent}, {to_parent})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(from_parent, to_parent), env=env,
                                     stdin=subprocess.DEVNULL)
        os.close(from_parent)
        os.close(to_parent)
        self.outbox = Connection(to_child, readable=False)
        self.inbox = Connection(from_child, writable=False)
        try:
            ready = self.inbox.poll(startup_timeout_s) and self.inbox.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError(f"reward worker did not start within {startup_timeout_s:.0f}s (see its stderr)")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)
        self.inbox.close()
        self.outbox.close()


class VerifierPool:
    """`size` reusable worker processes; `run(fn, *args, timeout_s=...)` from any thread. A call that overruns
    its deadline kills its worker (a fresh one is started on next use) and raises TimeoutError; one whose `fn`
    raises raises RuntimeError. `fn` must be importable by module path (it is pickled by reference)."""

    def __init__(self, size: int = 2, startup_timeout_s: float = 120.0):
        self._startup_timeout_s = startup_timeout_s
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()  # reuse warm workers first
        for _ in range(size):
            self._idle.put(None)  # a slot; its process starts on first use
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        worker = self._idle.get()
        if worker is not None and worker.proc.poll() is not None:  # died (or closed) while idle
            worker.kill()
            worker = None
        try:
            if worker is None:
                worker = _Worker(self._startup_timeout_s)
                with self._lock:
                    self._all.add(worker)
            worker.outbox.send((fn, args))
            if not worker.inbox.poll(timeout_s):
                raise TimeoutError(f"scoring took longer than {timeout_s:g}s")
            status, value = worker.inbox.recv()
        except BaseException:
            if worker is not None:
                with self._lock:
                    self._all.discard(worker)
                worker.kill()
            self._idle.put(None)
            raise
        self._idle.put(worker)
        if status == "error":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        """Kill the workers (idle slots restart on next use)."""
        with self._lock:
            workers, self._all = list(self._all), set()
        for w in workers:
            w.kill()


_POOL: VerifierPool | None = None
_POOL_LOCK = threading.Lock()


def default_pool() -> VerifierPool:
    """The process-wide pool shared by all math rewards (two workers, started on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = VerifierPool()
            atexit.register(_POOL.close)
        return _POOL


# ---- reward functions ----------------------------------------------------------------------------------------------
@dataclass
class MathReward:
    """Callable math reward with its own deadline (seconds) and, optionally, its own pool."""
    timeout_s: float = 5.0
    pool: VerifierPool | None = None

    def __call__(self, response_text: str, answer: str) -> RewardResult:
        pool = self.pool or default_pool()
        try:
            reward, correct, reason = pool.run(score_math, response_text, answer, timeout_s=self.timeout_s)
        except TimeoutError as e:
            return RewardResult(0.0, False, True, f"timeout: {e}")
        except Exception as e:  # verifier raised, worker died or could not start
            return RewardResult(0.0, False, True, f"verifier failed: {type(e).__name__}: {e}")
        return RewardResult(reward, correct, False, reason)


def _normalise(s: str, casefold: bool = False) -> str:
    s = " ".join(s.split())
    return s.casefold() if casefold else s


@dataclass
class ExactReward:
    """1 when the response equals the answer after collapsing whitespace (and case folding if asked)."""
    casefold: bool = False
    timeout_s: float | None = None  # accepted like every kind's (the run passes reward.timeout_s); never hangs

    def __call__(self, response_text: str, answer: str) -> RewardResult:
        ok = _normalise(response_text, self.casefold) == _normalise(answer, self.casefold)
        return RewardResult(float(ok), ok, False, "exact match" if ok else "mismatch")


def _synthetic(**kwargs: Any) -> RewardFn:
    from rl.tasks import score_positions   # here: the verifier processes import this module, not rl.tasks' deps
    if kwargs:
        raise TypeError(f"the synthetic reward takes no options, got {sorted(kwargs)}")
    return score_positions


REWARD_KINDS: dict[str, Callable[..., RewardFn]] = {"math": MathReward, "exact": ExactReward, "synthetic": _synthetic}


class RewardError(TypeError):
    """A reward function returned something other than a RewardResult with a finite real reward."""


def check_result(kind: str, result: Any, response_text: str = "") -> RewardResult:
    """`result` if it is a RewardResult whose reward is a finite real number (made a float), else RewardError naming
    the reward kind, what came back, and the start of the response it was scoring."""
    def about() -> str:   # built only for an error: this runs for every sample scored
        return f"reward kind {kind!r}, scoring response {response_text[:60]!r}"

    if not isinstance(result, RewardResult):
        raise RewardError(f"{about()}: returned {type(result).__name__} {result!r:.80}, not a RewardResult(reward: float,"
                          f" correct: bool, ...)")
    r = result.reward
    if isinstance(r, bool) or not isinstance(r, numbers.Real):
        raise RewardError(f"{about()}: returned a non-numeric reward {r!r:.80} ({type(r).__name__}); "
                          "RewardResult.reward must be a float")
    if not math.isfinite(r):
        raise RewardError(f"{about()}: returned a non-finite reward {r}")
    return result if type(r) is float else dataclasses.replace(result, reward=float(r))


class CheckedReward:
    """A reward function whose every result goes through `check_result`. The wrapped function is `.fn`; its other
    attributes (timeout_s, casefold, ...) read through the wrapper."""

    def __init__(self, kind: str, fn: RewardFn):
        self.kind, self.fn = kind, fn

    def __call__(self, response_text: str, answer: str) -> RewardResult:
        try:
            result = self.fn(response_text, answer)
        except Exception as e:  # isolated: this response scores 0 and is marked failed; the run goes on
            return RewardResult(0.0, False, True, f"reward kind {self.kind!r} raised {type(e).__name__}: {e}"[:500])
        return check_result(self.kind, result, response_text)

    def __getattr__(self, name: str) -> Any:
        if name in ("kind", "fn") or name.startswith("__"):  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.fn, name)

    def __repr__(self) -> str:
        return f"CheckedReward({self.kind!r}, {self.fn!r})"


def get_reward_fn(kind: str, **options: Any) -> CheckedReward:
    """The reward function for a config's `reward.kind`; options go to its constructor (e.g. timeout_s=2). Its
    results are checked (see `check_result`)."""
    if kind not in REWARD_KINDS:
        raise ValueError(f"unknown reward kind {kind!r}; valid kinds: {', '.join(REWARD_KINDS)}")
    return CheckedReward(kind, REWARD_KINDS[kind](**options))

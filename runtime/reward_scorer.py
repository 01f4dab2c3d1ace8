"""Reward scoring beside the engine, one interface (`RewardScorer`: submit, poll, close) and two scorers: inline
(`InlineScorer`, `reward.async_workers = 0`, the default) and asynchronous per-sample scoring with an adaptive
timeout (`AsyncRewardScorer`): RollPacker §4.3 (reward scheduler).

"Completed responses are dispatched to reward workers in parallel with the ongoing rollout stage": the rollout
worker hands each finished response to `submit` and goes back to decoding; `poll` returns the scores that are in,
without blocking. Each call runs in a small thread pool under the timeout its test case has earned so far
(`rl.reward_timeout.AdaptiveTimeout`: scale x the slowest correct run of that case, between min_s and max_s);
a call still running at its deadline is scored 0, not correct and `failed` ("terminated early and a zero reward
is assigned"; counted like every other verifier failure), and its run time feeds the anchor only when it finished
correct. A verifier that raises scores 0 with `failed` set; one that returns a malformed result
(`rl.rewards.RewardError`) is a bug and is re-raised from `poll`, stopping the run as the inline path does.
A verifier that blocks in a thread cannot be killed from Python, so the reward function's own hard limit (e.g.
the math verifier pool's `reward.timeout_s`, = max_s) bounds the abandoned call; the scorer just stops waiting
for it (`close` cancels the calls not started yet and never waits for running ones).

The runtime uses it in `runtime.rollout_worker.RolloutWorker` when `reward.async_workers > 0` (max_s =
`reward.timeout_s`, scale and min_s from `reward.timeout_scale` / `reward.timeout_min_s`, keyed by prompt), and the
inline scorer otherwise: that one scores each sample in `submit`, so the worker, which polls right after each submit,
sends a sample's `reward_scored` right behind its `trajectory_finished`, before the next engine step. An
asynchronous score goes out at the first engine step, or the first poll of an idle loop, after it is in, with the
same data and payload as inline.

Invariant kept: every submitted sample comes back from `poll` exactly once (scored, timed out, or failed).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol

from rl.rewards import RewardError, RewardResult
from rl.reward_timeout import AdaptiveTimeout


class RewardScorer(Protocol):
    """What the rollout worker asks of a scorer: `submit` a finished sample (`key` comes back with its score, `case`
    is its test case), `poll` the scores that are in as (key, RewardResult, seconds) without blocking, `len` the
    samples submitted and not yet polled, `close` at the end (the samples not yet polled are dropped)."""

    def __len__(self) -> int: ...

    def submit(self, key: Any, case: Hashable, text: str, answer: str) -> None: ...

    def poll(self) -> list[tuple[Any, RewardResult, float]]: ...

    def close(self) -> None: ...


class InlineScorer:
    """Scores each sample in `submit`, on the caller's thread (`reward.async_workers = 0`); `poll` hands back the
    scores submitted since the last poll. A reward function that raises stops the run here (the run's reward
    functions, rl.rewards.CheckedReward, score such a call 0 with `failed` set instead)."""

    def __init__(self, fn: Callable[[str, str], RewardResult], clock: Callable[[], float] = time.monotonic):
        self.fn, self.clock = fn, clock
        self.done: list[tuple[Any, RewardResult, float]] = []

    def __len__(self) -> int:
        return len(self.done)

    def submit(self, key: Any, case: Hashable, text: str, answer: str) -> None:
        t0 = self.clock()
        result = self.fn(text, answer)
        self.done.append((key, result, self.clock() - t0))

    def poll(self) -> list[tuple[Any, RewardResult, float]]:
        done, self.done = self.done, []
        return done

    def close(self) -> None:
        self.done.clear()


@dataclass
class _Job:
    key: Any
    case: Hashable
    timeout_s: float
    future: Future
    started: list[float] = field(default_factory=list)   # set by the worker thread when the call begins


class AsyncRewardScorer:
    """`submit(key, case, text, answer)`; `poll()` -> [(key, RewardResult, seconds)] of the finished ones."""

    def __init__(self, fn: Callable[[str, str], RewardResult], workers: int = 2,
                 timeout: AdaptiveTimeout | None = None, clock: Callable[[], float] = time.monotonic):
        if workers < 1:
            raise ValueError(f"reward scorer needs at least one worker, got {workers}")
        self.fn, self.timeout, self.clock = fn, timeout or AdaptiveTimeout(), clock
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        self.jobs: list[_Job] = []
        self.timed_out = 0

    def __len__(self) -> int:
        return len(self.jobs)

    def submit(self, key: Any, case: Hashable, text: str, answer: str) -> None:
        started: list[float] = []

        def run() -> tuple[RewardResult, float]:
            started.append(self.clock())
            result = self.fn(text, answer)
            return result, self.clock() - started[0]

        self.jobs.append(_Job(key, case, self.timeout.timeout_s(case), self.pool.submit(run), started))

    def poll(self) -> list[tuple[Any, RewardResult, float]]:
        """Scores that are in (in submission order), and calls past their deadline scored 0; never blocks."""
        now, out, keep = self.clock(), [], []
        for job in self.jobs:
            if job.future.done():
                try:
                    result, took = job.future.result()
                except RewardError:  # a malformed result is a bug to fix: stop, as the inline path does
                    raise
                except Exception as e:  # the reward function's own bug: counted as a failed score, never fatal
                    out.append((job.key, RewardResult(0.0, False, True, f"scorer raised {type(e).__name__}: {e}"),
                                0.0))
                    continue
                if took > job.timeout_s:   # finished, but after its deadline: the same verdict as a kill
                    out.append((job.key, self._killed(job), took))
                else:
                    self.timeout.observe(job.case, took, result.correct)
                    out.append((job.key, result, took))
            elif job.started and now - job.started[0] > job.timeout_s:
                job.future.cancel()
                out.append((job.key, self._killed(job), now - job.started[0]))
            else:
                keep.append(job)
        self.jobs = keep
        return out

    def _killed(self, job: _Job) -> RewardResult:
        self.timed_out += 1
        return RewardResult(0.0, False, True, f"terminated at the adaptive timeout {job.timeout_s:.3g}s")

    def drain(self, poll_s: float = 0.005) -> list[tuple[Any, RewardResult, float]]:
        """Wait for every submitted sample (each bounded by its timeout) and return them all."""
        out = self.poll()
        while self.jobs:
            time.sleep(poll_s)
            out += self.poll()
        return out

    def close(self) -> None:
        """Cancel the calls not started yet and forget every pending sample; never waits for a running call."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.jobs = []

"""Multi-turn, tool-using workloads: an episode is k model turns separated by k-1 tool calls (rl/env.py).

    prompt -> turn 1 -> [call 1: tool latency, then an observation of o_1 tokens] -> turn 2 -> ... -> turn k

An `Episode` lists its calls, each a `CallSpec(at, obs, seconds, failed)`: the call starts when the response reaches
`at` tokens (the end of a model turn), takes `seconds`, and then `obs` observation tokens are appended to the
response (prefilled, never trained: `Trajectory.loss_mask` 0). The response (every token after the prompt, model
turns and observations in order) is capped at the workload's `max_len`, as the runtime caps it: a model turn that
reaches the cap ends the episode there, and an observation that would reach it is cut at the cap and ends the
episode (finish_reason "length" either way); later calls are not made.

`AgenticWorkload`, per prompt p, sample k, turn j and call i (every draw a pure function of (seed, p, k, j or i)):

    z_p ~ N(0, 1)                              prompt difficulty, shared by the group (as sim/workload.py's)
    calls_p ~ U{calls_min .. calls_max}        the prompt's tool calls: every sample of its group makes as many
    turn_pkj = turn_median * exp(sigma_prompt z_p + sigma_sample e_pkj)     model tokens of turn j (>= 1)
    obs_pki = obs_median * exp(obs_sigma e'_pki), in [1, obs_max]          observation tokens of call i
    seconds_pki ~ the workload's `latency` (a `ToolLatency`); a call longer than `timeout_s` is cut there and fails

The number of calls is the prompt's, not the sample's: a task that needs a lookup and three computations needs them
whatever the sample (and a group's samples then share their episode shape, as their lengths correlate). In a real
run the model decides, and samples of one prompt may call more or less; that spread is not modelled. Tool latency is
drawn per call, independent of the prompt (a slow search is slow for whoever calls it).

Tool latency (`ToolLatency`), a named distribution or a recorded trace:
    lognormal   `LogNormalLatency(median, sigma, lo, hi)`: clipped to [lo, hi]
    mixture     `MixtureLatency(body, tail, tail_p)`: with probability tail_p log-uniform on tail = (lo, hi), else
                log-uniform on body = (lo, hi)
    trace       `TraceLatency` from a file of recorded seconds (`load_latency_trace`), drawn uniformly with
                replacement (a pure function of (seed, p, k, i)). The file: a JSON list of seconds (`[0.4, 2.1,
                ...]`), a JSON object `{"seconds": [...]}`, or JSON Lines with one number or one `{"seconds": x}`
                object per line (extra keys ignored); every value a finite number > 0.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rl.jsonl import iter_jsonl
from sim.workload import (PromptSpec, TraceError, Workload, WORKLOADS, _normal, _reward_draws, _split, _uniforms)


@dataclass(frozen=True)
class CallSpec:
    """One tool call of an episode: made when the response reaches `at` tokens; `obs` tokens come back after
    `seconds` (`failed`: the call timed out, its observation says so)."""
    at: int
    obs: int
    seconds: float
    failed: bool = False


@dataclass(frozen=True)
class Episode:
    calls: tuple[CallSpec, ...]
    length: int                  # response tokens of the whole episode: model turns + observations, <= max_len


# ------------------------------------------------------------------------------------------------ tool latency
class ToolLatency:
    """Seconds one tool call takes, from three uniforms in (0, 1)."""
    kind: str

    def seconds(self, u1: float, u2: float, u3: float) -> float:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


def _log_uniform(lo: float, hi: float, u: float) -> float:
    return lo * (hi / lo) ** u


@dataclass(frozen=True)
class LogNormalLatency(ToolLatency):
    median: float
    sigma: float
    lo: float = 0.0
    hi: float = math.inf
    kind: str = "lognormal"

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 0 <= self.lo <= self.hi):
            raise ValueError(f"lognormal tool latency: need median > 0, sigma >= 0, 0 <= lo <= hi, got {self}")

    def seconds(self, u1: float, u2: float, u3: float) -> float:
        return min(self.hi, max(self.lo, self.median * math.exp(self.sigma * _normal(u1, u2))))

    def describe(self) -> str:
        return f"lognormal(median {self.median:g} s, sigma {self.sigma:g}, in [{self.lo:g}, {self.hi:g}] s)"


@dataclass(frozen=True)
class MixtureLatency(ToolLatency):
    body: tuple[float, float]
    tail: tuple[float, float]
    tail_p: float
    kind: str = "mixture"

    def __post_init__(self) -> None:
        if not (0 < self.body[0] <= self.body[1] and 0 < self.tail[0] <= self.tail[1] and 0 <= self.tail_p <= 1):
            raise ValueError(f"mixture tool latency: need 0 < lo <= hi for body and tail and tail_p in [0, 1], "
                             f"got {self}")

    def seconds(self, u1: float, u2: float, u3: float) -> float:
        lo, hi = self.tail if u1 < self.tail_p else self.body
        return _log_uniform(lo, hi, u2)

    def mean(self) -> float:
        def lu(lo: float, hi: float) -> float:
            return lo if hi == lo else (hi - lo) / math.log(hi / lo)
        return (1 - self.tail_p) * lu(*self.body) + self.tail_p * lu(*self.tail)

    def describe(self) -> str:
        return (f"mixture({1 - self.tail_p:.0%} log-uniform {self.body[0]:g}-{self.body[1]:g} s, {self.tail_p:.0%} "
                f"log-uniform {self.tail[0]:g}-{self.tail[1]:g} s; mean {self.mean():.2f} s)")


@dataclass(frozen=True)
class TraceLatency(ToolLatency):
    values: tuple[float, ...]
    path: str = ""
    kind: str = "trace"

    def seconds(self, u1: float, u2: float, u3: float) -> float:
        return self.values[min(len(self.values) - 1, int(u1 * len(self.values)))]

    def describe(self) -> str:
        v = sorted(self.values)
        return (f"trace {Path(self.path).name or '(inline)'}: {len(v)} calls, median {v[len(v) // 2]:g} s, "
                f"max {v[-1]:g} s")


def _seconds_value(x: Any, where: str) -> float:
    if isinstance(x, dict):
        if "seconds" not in x:
            raise TraceError(f"{where}: field 'seconds' is missing")
        x = x["seconds"]
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise TraceError(f"{where}: a tool latency must be a finite number of seconds > 0, got {x!r}")
    return float(x)


def load_latency_trace(path: str | Path) -> TraceLatency:
    """Recorded tool-call seconds (the module docstring's formats); TraceError names the file, line and value."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: tool latency trace does not exist")
    values: list[float] = []
    if path.suffix == ".jsonl":
        for n, row in iter_jsonl(path, TraceError):
            values.append(_seconds_value(row, f"{path}:{n}"))
    else:
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TraceError(f"{path}: not valid JSON ({e})") from None
        if isinstance(data, dict):
            data = data.get("seconds")
        if not isinstance(data, list):
            raise TraceError(f"{path}: expected a JSON list of seconds or {{\"seconds\": [...]}}")
        values = [_seconds_value(x, f"{path}: entry {i}") for i, x in enumerate(data)]
    if not values:
        raise TraceError(f"{path}: tool latency trace holds no calls")
    return TraceLatency(tuple(values), str(path))


# --------------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class AgenticWorkload(Workload):
    name: str
    turn_median: float
    sigma_prompt: float
    sigma_sample: float
    calls_min: int
    calls_max: int
    obs_median: float
    obs_sigma: float
    obs_max: int
    latency: ToolLatency
    max_len: int
    timeout_s: float = math.inf
    prompt_median: float = 300.0
    prompt_sigma: float = 0.5
    prompt_max: int = 2048
    tool: str = "tool"
    seed: int = 0
    source: str = ""
    multi_turn = True

    def __post_init__(self) -> None:
        if not (1 <= self.calls_min <= self.calls_max and self.turn_median > 0 and self.obs_median > 0
                and self.obs_max >= 1 and self.max_len >= 1 and self.timeout_s > 0):
            raise ValueError(f"workload {self.name}: need 1 <= calls_min <= calls_max, positive medians, obs_max, "
                             f"max_len and timeout_s")

    def with_seed(self, seed: int) -> "AgenticWorkload":
        return replace(self, seed=seed)

    def with_latency(self, latency: ToolLatency) -> "AgenticWorkload":
        """The same episodes with tool latency drawn from `latency` instead (e.g. a recorded trace)."""
        return replace(self, latency=latency, name=f"{self.name}+{latency.kind}")

    def prompt(self, index: int) -> PromptSpec:
        u1, u2, u3, u4 = _uniforms(self.seed, self.name, index)
        z, z_len = _normal(u1, u2), _normal(u3, u4)
        plen = int(min(self.prompt_max, max(1, round(self.prompt_median * math.exp(self.prompt_sigma * z_len)))))
        return PromptSpec(plen, z, 1.0 / (1.0 + math.exp(1.5 * z)), *_reward_draws(self.seed, self.name, index))

    def calls_of(self, prompt_index: int) -> int:
        """The prompt's tool calls per episode (every sample of its group)."""
        u = _uniforms(self.seed, self.name, prompt_index, "calls")[0]
        return self.calls_min + min(self.calls_max - self.calls_min, int(u * (self.calls_max - self.calls_min + 1)))

    def episode(self, prompt_index: int, sample_index: int) -> Episode:
        z = self.prompt(prompt_index).difficulty
        n = self.calls_of(prompt_index)
        calls, pos = [], 0
        for j in range(n + 1):
            u1, u2, _, _ = _uniforms(self.seed, self.name, prompt_index, sample_index, "turn", j)
            turn = max(1, round(self.turn_median * math.exp(self.sigma_prompt * z + self.sigma_sample
                                                            * _normal(u1, u2))))
            pos += turn
            if pos >= self.max_len or j == n:
                return Episode(tuple(calls), min(pos, self.max_len))
            v1, v2, v3, v4 = _uniforms(self.seed, self.name, prompt_index, sample_index, "call", j)
            obs = int(min(self.obs_max, max(1, round(self.obs_median * math.exp(self.obs_sigma * _normal(v1, v2))))))
            w = _uniforms(self.seed, self.name, prompt_index, sample_index, "latency", j)
            seconds = self.latency.seconds(w[0], w[1], w[2])
            failed = seconds > self.timeout_s
            obs = min(obs, self.max_len - pos)
            calls.append(CallSpec(pos, obs, min(seconds, self.timeout_s), failed))
            pos += obs
            if pos >= self.max_len:
                return Episode(tuple(calls), pos)
        raise AssertionError("unreachable")

    def response_len(self, prompt_index: int, sample_index: int) -> int:
        return self.episode(prompt_index, sample_index).length


# The agentic preset. From the issue this workload answers: 1-8 tool calls per episode, tool latency long-tailed from
# 0.1 s to 60 s. Everything else is an assumption, named as such: 90% of calls log-uniform on 0.1-2 s (a calculator,
# a lookup, a short search) and 10% log-uniform on 2-60 s (a code run, a slow web request); the 60 s tail end is also
# the call's timeout, so no call of this preset fails; model turns of median 400 tokens (log-sigma 0.8, split by
# ICC 0.6 between prompt and sample as sim/workload.py's lengths), observations of median 128 tokens (log-sigma 1.0,
# at most 2048), prompts of median 600 tokens (a system prompt listing the tools), the response cap 8192 tokens
# (observations included), the same as rollpacker_7b_8k's so that the h800_7b profile and its KV pool fit both.
AGENTIC_LATENCY = MixtureLatency(body=(0.1, 2.0), tail=(2.0, 60.0), tail_p=0.1)


def _agentic() -> AgenticWorkload:
    sp, ss = _split(0.8)
    return AgenticWorkload(
        "agentic_7b_8k", turn_median=400, sigma_prompt=sp, sigma_sample=ss, calls_min=1, calls_max=8,
        obs_median=128, obs_sigma=1.0, obs_max=2048, latency=AGENTIC_LATENCY, max_len=8192, timeout_s=60.0,
        prompt_median=600, source=(
            "issue: 1-8 tool calls per episode (the prompt's, shared by its group), latency long-tailed 0.1-60 s; "
            "assumptions: 90% of calls log-uniform 0.1-2 s, 10% 2-60 s (timeout 60 s), model turns median 400 "
            "tokens (log-sigma 0.8, ICC 0.6), observations median 128 tokens (log-sigma 1.0, <= 2048), prompts "
            "median 600, response cap 8192 with observations"))


for _w in (_agentic(),):
    WORKLOADS[_w.name] = _w

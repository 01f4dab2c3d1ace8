"""A simulated output-length ranker of a stated quality: StreamRL §5.2's ranker as the simulator can have it.

A simulated prompt has no text, so no ranker can read its difficulty from its content; anything a simulated ranker
reads that predicts a length comes from the workload generator. Instead of a token carrying the generator's latent
difficulty (which no paper measures), `NoisyRanker` predicts each prompt's true response length (sample 0, the one a
PPO round generates; StreamRL replays one recorded length per prompt, §7 Dataset) times a log-normal error of its
own,

    predicted = true length x exp(sigma x e_p),   e_p ~ N(0, 1) a pure function of (seed, prompt index)

with sigma set so that its expected recall of the longest `q` of a round (|predicted top q ∩ true top q| / |true top
q|) is `recall`: StreamRL Table 4's measured recall (0.87 of the longest 20% for its Qwen2.5-7B ranker, 0.85 and
0.81 for 3B and 1.5B). sigma is found by bisection on the workload's own prompts, in rounds of `round_size`, so the
recall holds for the length distribution actually run (its cap and ties included). sigma = 0 is Fig. 9's oracle.

The error is independent of everything the system does (like a ranker trained offline before the run, §5.2: "a
one-time offline preprocessing step"), so the recall is a calibration, not a result; what a reproduction tests with
it is what the dispatch does with predictions of that quality (Algorithm 2, LPT).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from sim.workload import Workload, _normal, _uniforms

CALIBRATION_PROMPTS = 8192     # prompts the noise is calibrated on (8 rounds of 1024)


def recall_at(pred: Sequence[float], true: Sequence[float], q: float) -> float:
    """|predicted top q ∩ true top q| / |true top q| over one round (StreamRL Table 4's recall, our reading); ties
    break by position."""
    k = max(1, round(q * len(pred)))
    top_p = set(np.argsort(-np.asarray(pred, dtype=float), kind="stable")[:k].tolist())
    top_t = set(np.argsort(-np.asarray(true, dtype=float), kind="stable")[:k].tolist())
    return len(top_p & top_t) / k


def _seed(workload: Workload) -> int:
    """The workload's seed (a ramped workload's is its base's)."""
    return getattr(workload, "seed", None) or getattr(getattr(workload, "base", None), "seed", 0) or 0


def _error(workload: Workload, prompt_index: int) -> float:
    """The ranker's standard-normal error for a prompt: a pure function of (seed, prompt index)."""
    return _normal(*_uniforms(_seed(workload), "ranker", prompt_index)[:2])


def _errors(workload: Workload, n: int) -> np.ndarray:
    return np.array([_error(workload, i) for i in range(n)])


@functools.lru_cache(maxsize=64)
def noise_sigma(workload: Workload, recall: float, q: float = 0.2, round_size: int = 1024,
                prompts: int = CALIBRATION_PROMPTS) -> float:
    """The error sigma whose mean recall of the longest q per round, over the workload's first `prompts` prompts, is
    `recall` (bisection; recall 1 gives 0)."""
    if not 0 < q < 1 or not q < recall <= 1:
        raise ValueError(f"ranker: need 0 < q < 1 and q < recall <= 1 (a random ranking recalls q), got q={q}, "
                         f"recall={recall}")
    n = max(round_size, prompts // round_size * round_size)
    logs = np.log([max(1, workload.response_len(i, 0)) for i in range(n)])
    err = _errors(workload, n)

    def mean_recall(sigma: float) -> float:
        pred = logs + sigma * err
        return float(np.mean([recall_at(pred[i:i + round_size], logs[i:i + round_size], q)
                              for i in range(0, n, round_size)]))
    if mean_recall(0.0) <= recall:
        return 0.0
    lo, hi = 0.0, 1.0
    while mean_recall(hi) > recall:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_recall(mid) > recall else (lo, mid)
    return (lo + hi) / 2


@dataclass
class NoisyRanker:
    """A LengthPredictor (sched/policies/streamrl/length_rank.py) of the module docstring's model; `observe` learns
    nothing (the error is fixed, like an offline ranker's)."""
    workload: Workload
    sigma: float

    @classmethod
    def with_recall(cls, workload: Workload, recall: float, q: float = 0.2) -> "NoisyRanker":
        return cls(workload, noise_sigma(workload, recall, q))

    def predict(self, prompt_index: int, prompt_len: int, prompt_ids: Sequence[int] | None = None) -> float:
        true = max(1, self.workload.response_len(prompt_index, 0))
        if self.sigma == 0:
            return float(true)
        return true * math.exp(self.sigma * _error(self.workload, prompt_index))

    def observe(self, prompt_index: int, prompt_len: int, response_len: int,
                prompt_ids: Sequence[int] | None = None) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def install(policy: Any, ranker: NoisyRanker) -> int:
    """Give every skewness-aware dispatch of `policy` (its dispatch, or the one it delegates placement to) this
    ranker; the number replaced."""
    from sched.policies.streamrl.dispatch import SkewnessDispatch
    n = 0
    for d in (getattr(policy, "dispatch", None), getattr(getattr(policy, "dispatch", None), "inner", None)):
        if isinstance(d, SkewnessDispatch):
            d.ranker = ranker
            n += 1
    return n

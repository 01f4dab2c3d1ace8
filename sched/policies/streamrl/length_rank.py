"""Output-length ranking behind a small interface: StreamRL §5.2 (used by the `skewness` dispatch).

StreamRL's observation (§5.1, Opportunity 2): exact output lengths are hard to predict but their *ranking* is
not, because "difficulty is a property inherent to the prompts themselves". The paper fine-tunes a small LLM on
(prompt, output length) pairs and refreshes it online from recent generations; recall of the longest 20% is
about 0.8-0.9 (Table 4). Only the order of the predictions matters to the dispatcher.

`LengthPredictor` is what a dispatcher needs: `predict` a response length from what the views know of a prompt
(its index, its length and, where the caller has them, its token ids), and `observe` finished responses (the online
refresh). Registered by name, selected by `[dispatch] predictor = "name"`; a new one plugs in with
`@register_predictor("name")`:
- "history": the mean of this prompt's past response lengths; for an unseen prompt the mean response length so
  far, scaled by its prompt length relative to the mean prompt (the prompt length alone before any history);
- "prompt_length": longer prompt, longer answer;
- "learned": the paper's learned ranker in miniature (`LearnedPredictor` below): an online ridge regression of the
  log response length on features of the prompt itself (length, hashed token unigrams and bigrams), refit from every
  finished sample with exponential forgetting (the online fine-tuning of §5.2), shrunk toward a prompt's own past
  lengths once it has some. Unlike "history" it generalises to prompts never seen, from their content.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from rl.types import RunLengthSequence


class LengthPredictor(Protocol):
    def predict(self, prompt_index: int, prompt_len: int, prompt_ids: Sequence[int] | None = None) -> float: ...
    def observe(self, prompt_index: int, prompt_len: int, response_len: int,
                prompt_ids: Sequence[int] | None = None) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


PREDICTORS: dict[str, Callable[[], LengthPredictor]] = {}


def register_predictor(name: str):
    def deco(cls):
        PREDICTORS[name] = cls
        return cls
    return deco


@register_predictor("prompt_length")
class PromptLengthPredictor:
    def predict(self, prompt_index: int, prompt_len: int, prompt_ids: Sequence[int] | None = None) -> float:
        return float(prompt_len)

    def observe(self, prompt_index: int, prompt_len: int, response_len: int,
                prompt_ids: Sequence[int] | None = None) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@register_predictor("history")
class HistoryPredictor:
    def __init__(self) -> None:
        self.per_prompt: dict[int, list[float]] = {}   # prompt_index -> [sum of response lengths, count]
        self.total = [0.0, 0.0, 0.0]                   # sum of response lengths, sum of prompt lengths, count

    def predict(self, prompt_index: int, prompt_len: int, prompt_ids: Sequence[int] | None = None) -> float:
        if prompt_index in self.per_prompt:
            s, n = self.per_prompt[prompt_index]
            return s / n
        resp, prompt, n = self.total
        return resp / n * prompt_len / max(prompt / n, 1e-9) if n else float(prompt_len)

    def observe(self, prompt_index: int, prompt_len: int, response_len: int,
                prompt_ids: Sequence[int] | None = None) -> None:
        h = self.per_prompt.setdefault(prompt_index, [0.0, 0.0])
        h[0] += response_len
        h[1] += 1
        self.total = [self.total[0] + response_len, self.total[1] + prompt_len, self.total[2] + 1]

    def state_dict(self) -> dict[str, Any]:
        return {"per_prompt": {k: list(v) for k, v in self.per_prompt.items()}, "total": list(self.total)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.per_prompt = {int(k): list(v) for k, v in state.get("per_prompt", {}).items()}
        self.total = list(state.get("total", [0.0, 0.0, 0.0]))

@register_predictor("learned")
class LearnedPredictor:
    """StreamRL §5.2's learned ranker in miniature, hidden-state free. The paper fine-tunes a small LLM on (prompt,
    output length) pairs and refreshes it online "using recent generation results"; only the ranking matters.
    Here an online ridge regression, cheap enough to refit after every finished sample on the controller's thread
    and identical under the simulator:

        target    y = log(1 + response_len)          (heavy-tailed lengths; ranks are unchanged by the log)
        features  x = [1, log(1 + prompt_len), hashed counts of token unigrams and bigrams of the first
                       `max_tokens` tokens, divided by their number]   (so it generalises to unseen prompts)
        fit       A <- forget * A + x x^T,  b <- forget * b + y x,   w = (A + ridge * I)^-1 b   (solved lazily)
        predict   c = x . w for an unseen prompt; for one with n past responses of mean log length m, the shrunk
                  (n m + prior * c) / (n + prior): its own history outweighs the content model as it accumulates

    `forget` < 1 discounts old samples, so the model tracks the policy whose lengths drift during RL. Before any
    observation it ranks by prompt length, like the "prompt_length" baseline.

    Invariant kept: a prediction depends only on samples already observed (nothing of the pending round leaks in).
    """

    @dataclass
    class Params:
        buckets: int = 32          # hash buckets for unigrams, and as many for bigrams
        ridge: float = 1.0         # L2 prior on the weights
        forget: float = 0.999      # per-observation decay of old samples (1: never forget)
        max_tokens: int = 512      # prompt tokens looked at (the first ones)
        prior: float = 2.0         # weight of the content model against a prompt's own past responses

        def __post_init__(self) -> None:
            if (self.buckets < 1 or self.ridge <= 0 or not 0 < self.forget <= 1 or self.max_tokens < 1
                    or self.prior < 0):
                raise ValueError(f"learned length predictor: need buckets >= 1, ridge > 0, 0 < forget <= 1, "
                                 f"max_tokens >= 1 and prior >= 0, got {self}")

    def __init__(self, params: "LearnedPredictor.Params | None" = None):
        self.p = params if params is not None else self.Params()
        self.dim = 2 + 2 * self.p.buckets
        self.A = np.zeros((self.dim, self.dim))
        self.b = np.zeros(self.dim)
        self.n = 0.0                                     # observations, discounted like A and b
        self.w: np.ndarray | None = None                 # cached solution (None: refit before the next predict)
        self.history: dict[int, list[float]] = {}        # prompt_index -> [sum of log lengths, count]

    # ------------------------------------------------------------------------------------------------ features
    def features(self, prompt_len: int, prompt_ids: Sequence[int] | None) -> np.ndarray:
        x = np.zeros(self.dim)
        x[0], x[1] = 1.0, math.log1p(prompt_len)
        if prompt_ids is None:
            return x
        B, n, prev = self.p.buckets, 0, None
        for t, c in _runs(prompt_ids, self.p.max_tokens):   # a run of c equal tokens: c unigrams, c - 1 bigrams
            x[2 + _bucket(t, B)] += c
            if prev is not None:
                x[2 + B + _bucket(prev * 1_000_003 + t, B)] += 1
            if c > 1:
                x[2 + B + _bucket(t * 1_000_003 + t, B)] += c - 1
            prev, n = t, n + c
        if n:
            x[2:] /= n
        return x

    # ------------------------------------------------------------------------------------------ the interface
    def predict(self, prompt_index: int, prompt_len: int, prompt_ids: Sequence[int] | None = None) -> float:
        if self.n == 0:
            return float(prompt_len)
        if self.w is None:
            self.w = np.linalg.solve(self.A + self.p.ridge * np.eye(self.dim), self.b)
        y = float(self.features(prompt_len, prompt_ids) @ self.w)
        h = self.history.get(prompt_index)
        if h is not None:
            y = (h[0] + self.p.prior * y) / (h[1] + self.p.prior)
        return math.expm1(min(max(y, 0.0), 30.0))

    def observe(self, prompt_index: int, prompt_len: int, response_len: int,
                prompt_ids: Sequence[int] | None = None) -> None:
        x = self.features(prompt_len, prompt_ids)
        y = math.log1p(max(response_len, 0))
        f = self.p.forget
        self.A = f * self.A + np.outer(x, x)
        self.b = f * self.b + y * x
        self.n = f * self.n + 1.0
        self.w = None
        h = self.history.setdefault(prompt_index, [0.0, 0.0])
        h[0] += y
        h[1] += 1

    def state_dict(self) -> dict[str, Any]:
        return {"A": self.A.tolist(), "b": self.b.tolist(), "n": self.n,
                "history": {k: list(v) for k, v in self.history.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        A = np.asarray(state["A"], dtype=float)
        if A.shape != (self.dim, self.dim):
            raise ValueError(f"learned length predictor: state has {A.shape[0]} features, this one {self.dim} "
                             f"(buckets changed?)")
        self.A, self.b, self.n, self.w = A, np.asarray(state["b"], dtype=float), float(state["n"]), None
        self.history = {int(k): list(v) for k, v in state.get("history", {}).items()}


def _runs(ids: Sequence[int], limit: int) -> Iterator[tuple[int, int]]:
    """The first `limit` tokens as (token, count) runs (a run-length sequence is read run by run)."""
    if isinstance(ids, RunLengthSequence):
        left = limit
        for t, c in ids.runs:
            if left <= 0:
                return
            yield t, min(c, left)
            left -= c
        return
    for t, grp in itertools.groupby(itertools.islice(iter(ids), limit)):
        yield t, sum(1 for _ in grp)


def _bucket(key: int, buckets: int) -> int:
    """A fixed hash (Python's own hash of ints is the identity, which would put neighbouring ids side by side)."""
    return ((int(key) * 2_654_435_761) >> 7) % buckets

"""The learned output-length ranker: StreamRL §5.2 ("Output length ranker"), in miniature and hidden-state free.

StreamRL fine-tunes a small LLM on (prompt, output length) pairs, ranks each round's prompts by its estimates,
and refreshes it online "using recent generation results"; only the ranking matters (Table 4 reports recall of
the longest 20%). Here the ranker is an online ridge regression, cheap enough to refit after every finished sample
on the controller's thread and identical under the simulator:

    target    y = log(1 + response_len)                   (lengths are heavy-tailed; the log keeps the tail from
                                                            dominating the fit, and ranks are unchanged by it)
    features  x = [1, log(1 + prompt_len),                 the prompt itself, so it generalises to unseen prompts
                   hashed counts of token unigrams and bigrams (first `max_tokens` tokens, divided by their number)]
    fit       A <- forget * A + x x^T,  b <- forget * b + y x,   w = (A + ridge * I)^-1 b   (solved lazily)
    predict   c = x . w for an unseen prompt; for one with n past responses of mean log length m, the shrunk
              (n m + prior * c) / (n + prior): its own history outweighs the content model as it accumulates

`forget` < 1 discounts old samples, so the model tracks the policy whose lengths drift during RL (the paper's
online fine-tuning). Before any observation it ranks by prompt length, like the "prompt_length" baseline.

Invariant kept: a prediction depends only on samples already observed (nothing about the pending round leaks in).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from sched.length_rank import register_predictor


@register_predictor("learned")
class LearnedPredictor:
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
        if prompt_ids is not None:
            toks = list(itertools.islice(iter(prompt_ids), self.p.max_tokens))
            B = self.p.buckets
            for t in toks:
                x[2 + _bucket(t, B)] += 1.0
            for a, c in zip(toks, toks[1:]):
                x[2 + B + _bucket(a * 1_000_003 + c, B)] += 1.0
            if toks:
                x[2:] /= len(toks)
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


def _bucket(key: int, buckets: int) -> int:
    """A fixed hash (Python's own hash of ints is the identity, which would put neighbouring ids side by side)."""
    return ((int(key) * 2_654_435_761) >> 7) % buckets

"""What a request asks of the sampler: temperature, top-p, top-k, length, stop tokens, seed."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0 and top_p 1 switch those truncations off (top-k is applied first).

    `seed`: the request's n-th token is drawn with a uniform hashed from (seed, n) (engine/sampler.py), so its
    tokens depend on nothing else in the batch nor on where it runs or resumes; None draws from the engine's own
    generator (reproducible per engine seed, but batch-dependent). Taken modulo 2**64.
    `ignore_eos`: keep going past the model's EOS (benchmarks); `stop_token_ids` still stop.
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1

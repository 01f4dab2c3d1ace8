"""Next-token sampling for a batch of rows, each with its own params and (optionally) its own seeded generator.

Two logprobs come back for the sampled token:
  * `logprobs`: log_softmax(logits / T) -- the raw model with the request's temperature T applied and NO top-k /
    top-p truncation (T = 1 for greedy rows). This is what the trainer's importance ratio uses as the behaviour
    policy's logprob, and what `Transformer.forward_packed(...) / T` followed by log_softmax reproduces.
  * `sampling_logprobs`: under the distribution actually sampled from, i.e. the temperature-scaled distribution
    restricted to the top-k / top-p set and renormalised (0.0 for greedy rows, a point mass).

Sampling is by inverse CDF: one uniform u per row, token = the first index whose cumulative probability exceeds
u * total. A row whose request has a seed draws u = counter_uniform(seed, n) for its n-th generated token: a hash
of the two integers, computed for all such rows in a few vectorised integer ops on the host and copied over at
once. Its tokens therefore depend on nothing else in the batch and carry no generator state (a request exported
after n tokens and resumed anywhere, on another engine or device, draws the same u for token n), and a batch of
256 seeded rows costs one copy, not 256 generator launches (4.6 ms of an 18 ms decode step on an H100 before:
bench/results/gpu-h100.md). Rows without a seed share one draw from the engine's generator. The host waits only for the
sampled tokens. A batch of plain temperature sampling (no greedy row, no truncation: GRPO's rollouts) runs as one
kernel (kernels/sample.py: Triton on CUDA, or a registered kernel: cpu/'s C one for fp32 CPU logits), which reads
the logits a few times instead of materialising the scaled logits, log-probs, probabilities and their cumulative
sum over the whole vocabulary.
What the params ask of each row (temperatures, greedy rows, the seeds' half of the hash) is worked out once per
batch composition (`BatchParams`), not every step: on the CPU the per-row Python of the sampler was most of its
~280 us a decode step at batch 256.

A row whose logits are not finite (NaN or +inf anywhere, or every entry -inf: its log-softmax is NaN) samples no
token: it gets `ERROR_TOKEN` (and NaN logprobs), and the engine finishes that request with finish_reason "error"
instead of appending the token. The check reads the sampled logprobs, which come to the host anyway.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

ERROR_TOKEN = -1  # sampled for a row with non-finite logits: no token, the request ends with an error

from engine.sampling import SamplingParams
from kernels.dispatch import impl_for, use_triton
from kernels.sample import sample, sample_inverse_cdf


@dataclass
class BatchParams:
    """What the sampler needs of a batch's params, row by row, computed once per batch composition: a decode step's
    batch is usually the previous step's (the same params objects in the same order), so `Sampler` reuses it."""
    params: list[SamplingParams]
    greedy: list[bool]
    temps: torch.Tensor              # [B] fp32 on the host: T per row, 1 for greedy rows
    seeded: list[int]                # rows with their own seed
    seed_hash: np.ndarray | None     # their seeds' half of counter_uniform's hash
    truncates: bool                  # some non-greedy row has top-k / top-p
    device_cache: dict = field(default_factory=dict)  # the tensors above on the logits' device

    @classmethod
    def of(cls, params: list[SamplingParams]) -> BatchParams:
        greedy = [p.greedy for p in params]
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        return cls(list(params), greedy,
                   torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32),
                   seeded, seed_hash([params[i].seed for i in seeded]) if seeded else None,  # type: ignore[misc]
                   any(p.truncates and not g for p, g in zip(params, greedy)))

    def same(self, params: list[SamplingParams]) -> bool:
        return len(params) == len(self.params) and all(map(operator.is_, params, self.params))

    def on(self, device: torch.device, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The host tensor `make()` gives, on `device`, copied once per batch composition."""
        t = self.device_cache.get(key)
        if t is None:
            t = self.device_cache[key] = make().to(device, non_blocking=True)
        return t


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, fused: bool = True):
        self.device = device
        self.fused = fused  # plain temperature batches through kernels/sample.py's kernels (Triton, or registered)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._batch: BatchParams | None = None

    def batch_params(self, params: list[SamplingParams]) -> BatchParams:
        if self._batch is None or not self._batch.same(params):
            self._batch = BatchParams.of(params)
        return self._batch

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], counters: list[int]
                 ) -> tuple[list[int], list[float], list[float]]:
        """logits [B, V] (any float dtype; computed in fp32), each row's params and the index of the token it draws
        (its request's generated-token count) -> (tokens, logprobs, sampling_logprobs), lists of B."""
        B = logits.shape[0]
        b = self.batch_params(params)
        greedy = b.greedy
        temps = b.on(logits.device, "temps", lambda: b.temps)
        if (self.fused and not b.truncates and not any(greedy)
                and (use_triton(None, logits) or impl_for("sample", None, logits) is not None)):
            # plain temperature sampling (GRPO's rollouts): one fused kernel, no [B, V] intermediates
            tokens, lp = sample(logits, temps, self._uniforms(b, counters, logits.device))
            return self._lists(tokens, lp, None, greedy)
        scaled = logits / temps[:, None]  # fp32 (promoted), in one pass
        logprobs = torch.log_softmax(scaled, dim=-1)
        if b.truncates:
            top_k = torch.tensor([p.top_k for p in params], device=logits.device)
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            sampling_logprobs = torch.log_softmax(truncate(scaled, top_k, top_p), dim=-1)
        else:
            sampling_logprobs = logprobs
        if all(greedy):
            tokens = logits.argmax(-1)
        else:
            tokens = sample_inverse_cdf(sampling_logprobs.exp(), self._uniforms(b, counters, logits.device))
            if any(greedy):
                tokens = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(-1), tokens)
        rows = torch.arange(B, device=logits.device)
        return self._lists(tokens, logprobs[rows, tokens],
                           None if sampling_logprobs is logprobs else sampling_logprobs[rows, tokens], greedy)

    @staticmethod
    def _lists(tokens: torch.Tensor, lp: torch.Tensor, slp: torch.Tensor | None, greedy: list[bool]
               ) -> tuple[list[int], list[float], list[float]]:
        """The host's lists (the one wait for the device); ERROR_TOKEN where the logprob is NaN. `slp` None: the
        sampling logprobs are the logprobs (no truncation)."""
        tokens_l, lp_l = tokens.tolist(), lp.tolist()
        if any(map(math.isnan, lp_l)):
            tokens_l = [ERROR_TOKEN if math.isnan(x) else t for t, x in zip(tokens_l, lp_l)]
        slp_l = lp_l if slp is None else slp.tolist()
        return tokens_l, lp_l, [0.0 if g else x for g, x in zip(greedy, slp_l)] if any(greedy) else list(slp_l)

    def _uniforms(self, b: BatchParams, counters: list[int], device: torch.device) -> torch.Tensor:
        u = torch.rand(len(b.params), generator=self.generator, device=device)
        if b.seeded:  # seeded rows: counter-based draws, hashed on the host for all of them at once, one small copy
            own = counters if len(b.seeded) == len(counters) else [counters[i] for i in b.seeded]
            mine = torch.from_numpy(counter_hash(b.seed_hash, own))  # type: ignore[arg-type]
            if len(b.seeded) == len(counters) and device.type == "cpu":
                return mine
            u[b.on(device, "seeded", lambda: torch.tensor(b.seeded))] = mine.to(device, non_blocking=True)
        return u


def _mix32(x: np.ndarray) -> np.ndarray:
    """A bijective 32-bit integer hash with full avalanche (the 'lowbias32' constants of C. Wellons' hash search);
    uint32 arrays wrap on overflow."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def seed_hash(seeds: list[int]) -> np.ndarray:
    """The seeds' half of `counter_uniform` (uint32 per seed, taken modulo 2**64), reusable for every counter."""
    s = np.array([x & 0xFFFFFFFFFFFFFFFF for x in seeds], dtype=np.uint64)
    h = _mix32((s & np.uint64(0xFFFFFFFF)).astype(np.uint32) ^ np.uint32(0x9E3779B9))
    return _mix32(h ^ (s >> np.uint64(32)).astype(np.uint32))


def counter_hash(seed_h: np.ndarray, counters: list[int]) -> np.ndarray:
    """`counter_uniform` from the seeds' `seed_hash` (counters taken modulo 2**32)."""
    c = np.array(counters, dtype=np.int64).astype(np.uint32)
    h = _mix32(seed_h ^ c)
    h = _mix32(h ^ np.uint32(0x85EBCA6B))  # a last round so that neighbouring counters differ in every bit
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / (1 << 24))


def counter_uniform(seeds: list[int], counters: list[int]) -> np.ndarray:
    """u in [0, 1) (float32, 24 random bits) for each (seed, counter) pair, seeds taken modulo 2**64 and counters
    modulo 2**32: the same pair gives the same u in any batch, on any engine or device; distinct pairs give
    independent-looking draws."""
    return counter_hash(seed_hash(seeds), counters)


def truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k (0: no limit), then outside its top-p nucleus, to -inf. Top-p keeps the
    smallest set of most likely tokens whose mass reaches p (always at least one)."""
    V = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs  # probability of the strictly more likely tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)

"""Next-token sampling for a batch of rows, each with its own params and (optionally) its own seeded generator.

Two logprobs come back for the sampled token:
  * `logprobs`: log_softmax(logits / T) -- the raw model with the request's temperature T applied and NO top-k /
    top-p truncation (T = 1 for greedy rows). This is what the trainer's importance ratio uses as the behaviour
    policy's logprob, and what `Transformer.forward_packed(...) / T` followed by log_softmax reproduces.
  * `sampling_logprobs`: under the distribution actually sampled from, i.e. the temperature-scaled distribution
    restricted to the top-k / top-p set and renormalised (0.0 for greedy rows, a point mass).

Sampling is by inverse CDF: one uniform u per row, token = the first index whose cumulative probability exceeds
u * total. One random number per row keeps per-request generators cheap (a row with its own generator draws its u
from it; the others share one draw from the engine's generator), and nothing syncs with the host.

A row whose logits are not finite (NaN or +inf anywhere, or every entry -inf: its log-softmax is NaN) samples no
token: it gets `ERROR_TOKEN` (and NaN logprobs), and the engine finishes that request with finish_reason "error"
instead of appending the token. The check reads the sampled logprobs, which come to the host anyway.
"""
from __future__ import annotations

import math

import torch

ERROR_TOKEN = -1  # sampled for a row with non-finite logits: no token, the request ends with an error

from engine.sampling import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
                 ) -> tuple[list[int], list[float], list[float]]:
        """logits [B, V] (any float dtype; computed in fp32) -> (tokens, logprobs, sampling_logprobs), lists of B."""
        logits = logits.float()
        B = logits.shape[0]
        greedy = [p.greedy for p in params]
        temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=logits.device)
        scaled = logits / temps[:, None]
        logprobs = torch.log_softmax(scaled, dim=-1)
        if any(p.truncates and not g for p, g in zip(params, greedy)):
            top_k = torch.tensor([p.top_k for p in params], device=logits.device)
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            sampling_logprobs = torch.log_softmax(truncate(scaled, top_k, top_p), dim=-1)
        else:
            sampling_logprobs = logprobs
        if all(greedy):
            tokens = logits.argmax(-1)
        else:
            tokens = sample_inverse_cdf(sampling_logprobs.exp(), self._uniforms(generators, logits.device))
            if any(greedy):
                tokens = torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(-1), tokens)
        rows = torch.arange(B, device=logits.device)
        lp = logprobs[rows, tokens]
        slp = sampling_logprobs[rows, tokens]
        tokens_l, lp_l, slp_l = tokens.tolist(), lp.tolist(), slp.tolist()
        tokens_l = [ERROR_TOKEN if math.isnan(x) else t for t, x in zip(tokens_l, lp_l)]
        return tokens_l, lp_l, [0.0 if g else x for g, x in zip(greedy, slp_l)]

    def _uniforms(self, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
        u = torch.rand(len(generators), generator=self.generator, device=device)
        own = [i for i, g in enumerate(generators) if g is not None]
        if own:  # one draw from each row's own generator, written in one op
            u.index_copy_(0, torch.tensor(own, device=device),
                          torch.cat([torch.rand(1, generator=generators[i], device=device) for i in own]))
        return u


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (unnormalised is fine), u [B] uniform in [0, 1) -> one index per row, i with probability
    probs_i / sum(probs). Never an index of zero probability (cdf ties are skipped, rounding is clamped)."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # idx lands on a token of positive probability (a zero-probability token repeats the cdf value before it, and
    # right=True skips ties), except past the end when rounding makes u * total reach the total: those rows take
    # their last token of positive probability instead
    V = probs.shape[-1]
    over = idx >= V
    last_nonzero = V - 1 - (probs.flip(-1) > 0).int().argmax(-1) if probs.is_cuda or bool(over.any()) else idx
    return torch.where(over, last_nonzero, idx)


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

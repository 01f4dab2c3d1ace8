"""Sampling one token from each row of logits at a temperature, with no top-k / top-p truncation, by inverse CDF
with a given uniform per row, and the token's logprob under log_softmax(logits / T) (engine/sampler.py's
contract: the GRPO rollout's case). This file: the reference (torch: log_softmax, cumsum, searchsorted) and the
dispatcher; the Triton kernel, which reads each row twice and writes two numbers instead of materialising four
[B, V] fp32 tensors, is in kernels/triton_ops/sample.py (a C counterpart for fp32 CPU logits registers itself
from cpu/sample.py).
"""
from __future__ import annotations

import torch

from kernels.dispatch import impl_for, use_triton


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (unnormalised is fine), u [B] uniform in [0, 1) -> one index per row, i with probability
    probs_i / sum(probs). Never an index of zero probability: the first index whose cdf exceeds the target has a
    cdf strictly above its predecessor's (a zero-probability token repeats the cdf value before it), and the target
    u * total is kept strictly below the total (u * total can round up to it), so such an index always exists."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    return idx.clamp_(max=probs.shape[-1] - 1)  # past the end only for a row of no positive probability (an error)


def sample_ref(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype), temps [B] > 0, u [B] in [0, 1) -> (tokens [B] int64, logprobs [B] fp32 of
    the tokens under log_softmax(logits / temps)). A row with non-finite logits gets a NaN logprob."""
    logprobs = torch.log_softmax(logits / temps.float()[:, None], dim=-1)
    tokens = sample_inverse_cdf(logprobs.exp(), u)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def sample(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor, *, impl: str | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher (see `sample_ref`): the Triton kernel on CUDA, a registered implementation that takes the tensors
    (the C kernel for fp32 on the CPU, cpu/), else the reference; impl forces Triton or the reference
    (kernels/dispatch.py)."""
    if logits.dim() != 2 or temps.shape != (logits.shape[0],) or u.shape != (logits.shape[0],):
        raise ValueError(f"sample: logits [B, V] with temps and u [B], got {tuple(logits.shape)}, "
                         f"{tuple(temps.shape)}, {tuple(u.shape)}")
    if use_triton(impl, logits, temps, u):
        from kernels.triton_ops.sample import sample_triton
        return sample_triton(logits, temps, u)
    fn = impl_for("sample", impl, logits, temps, u)
    if fn is not None:
        return fn(logits, temps, u)
    return sample_ref(logits, temps, u)

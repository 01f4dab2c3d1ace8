"""Triton temperature sampling by inverse CDF (contract: kernels.sample.sample_ref).

`_sample_kernel`, one program per row, two passes over the vocabulary in tiles of BLOCK_V:
  1. the scaled logits' max m and s = sum e^(z - m) (online, rescaled as the max grows);
  2. the running sum of e^(z - m) tile by tile; the token is the first index whose running sum exceeds u * s (the
     last index of positive probability if rounding leaves the running total just short of u * s).
Its logprob is z_token - m - log s. Rows with NaN or +inf logits, or all -inf, give a NaN logprob (the engine ends
such a request with an error) and an index inside the row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sample_kernel(x_ptr, temp_ptr, u_ptr, tok_ptr, lp_ptr, V, stride_x, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    temp = tl.load(temp_ptr + row).to(tl.float32)
    offs = tl.arange(0, BLOCK_V)
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
    for start in range(0, V, BLOCK_V):
        ok = start + offs < V
        z = tl.load(base + start + offs, mask=ok, other=float("-inf")).to(tl.float32) / temp
        m_new = tl.maximum(m, tl.max(z, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: keep exp() away from -inf - -inf
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), 0)
        m = m_new
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    target = tl.load(u_ptr + row).to(tl.float32) * s
    carry = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
    found = tl.min(tl.full([BLOCK_V], V, tl.int64), 0)
    last = tl.max(tl.full([BLOCK_V], -1, tl.int64), 0)
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        ok = idx < V
        z = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32) / temp
        e = tl.exp(z - m_ref)
        run = tl.cumsum(e, 0) + carry
        positive = ok & (e > 0)
        found = tl.minimum(found, tl.min(tl.where(positive & (run > target), idx, V), 0))
        last = tl.maximum(last, tl.max(tl.where(positive, idx, -1), 0))
        carry += tl.sum(e, 0)
    tok = tl.where(found < V, found, tl.maximum(last, 0))
    z_tok = tl.load(base + tok).to(tl.float32) / temp
    tl.store(tok_ptr + row, tok)
    tl.store(lp_ptr + row, z_tok - m_ref - tl.log(s))


def sample_triton(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `sample_ref`."""
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    B, V = x.shape
    tokens = torch.empty(B, dtype=torch.int64, device=x.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=x.device)
    if B:
        _sample_kernel[(B,)](x, temps.float().contiguous(), u.float().contiguous(), tokens, logprobs, V, x.stride(0),
                             BLOCK_V=min(4096, triton.next_power_of_2(V)), num_warps=8)
    return tokens, logprobs

"""Triton row kernels of the chunked logprob + entropy (the maths: kernels/logprobs.py; contracts: its `_stats_ref`
and `_grad_ref`). Each reads every logit once:
- `_stats_kernel`, one program per row: online logsumexp, target logit and E[z] over vocabulary tiles;
- `_grad_kernel`, grid (row, vocabulary tile): dL/dlogits, written over the logits in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stats_kernel(raw_ptr, tgt_ptr, lse_ptr, zt_ptr, ez_ptr, V, stride_r, inv_temp,
                  WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row: a single pass over the vocabulary with a running max m, s = sum e^(z-m), a = sum e^(z-m) z."""
    row = tl.program_id(0).to(tl.int64)
    base = raw_ptr + row * stride_r
    offs = tl.arange(0, BLOCK_V)
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
    a = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
    for start in range(0, V, BLOCK_V):
        ok = start + offs < V
        z = tl.load(base + start + offs, mask=ok, other=0.0).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(tl.where(ok, z, float("-inf")), 0))
        scale = tl.exp(m - m_new)
        e = tl.where(ok, tl.exp(z - m_new), 0.0)
        s = s * scale + tl.sum(e, 0)
        if WITH_ENTROPY:
            a = a * scale + tl.sum(e * z, 0)
        m = m_new
    tgt = tl.load(tgt_ptr + row).to(tl.int64)
    tl.store(lse_ptr + row, m + tl.log(s))
    tl.store(zt_ptr + row, tl.load(base + tgt).to(tl.float32) * inv_temp)
    if WITH_ENTROPY:
        tl.store(ez_ptr + row, a / s)


@triton.jit
def _grad_kernel(raw_ptr, tgt_ptr, lse_ptr, ez_ptr, glp_ptr, gent_ptr, Vc, col0, stride_r, inv_temp,
                 HAS_ENT: tl.constexpr, BLOCK_V: tl.constexpr):
    """One (row, vocabulary tile): overwrite raw logits with dL/dlogits."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = cols < Vc
    ptrs = raw_ptr + row * stride_r + cols
    z = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32) * inv_temp
    g_lp = tl.load(glp_ptr + row)
    p = tl.exp(z - tl.load(lse_ptr + row))
    coef = g_lp + tl.zeros([BLOCK_V], tl.float32)
    if HAS_ENT:
        coef += tl.load(gent_ptr + row) * (z - tl.load(ez_ptr + row))
    dz = -p * coef + tl.where(cols + col0 == tl.load(tgt_ptr + row), g_lp, 0.0)
    tl.store(ptrs, (dz * inv_temp).to(raw_ptr.dtype.element_ty), mask=ok)


def stats_triton(raw: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Same contract as `_stats_ref`, for fp16/bf16/fp32 logits."""
    C, V = raw.shape
    lse, zt = (torch.empty(C, dtype=torch.float32, device=raw.device) for _ in range(2))
    ez = torch.empty_like(lse) if with_entropy else lse
    _stats_kernel[(C,)](raw, targets, lse, zt, ez, V, raw.stride(0), 1.0 / temperature,
                        WITH_ENTROPY=with_entropy, BLOCK_V=min(4096, triton.next_power_of_2(V)), num_warps=8)
    return lse, zt, (ez if with_entropy else None)


def grad_triton(raw: torch.Tensor, targets: torch.Tensor, col0: int, lse: torch.Tensor, ez: torch.Tensor | None,
                g_lp: torch.Tensor, g_ent: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """Same contract as `_grad_ref`; writes dL/dlogits over `raw` and returns it."""
    T, Vc = raw.shape
    block_v = min(4096, triton.next_power_of_2(Vc))
    _grad_kernel[(T, triton.cdiv(Vc, block_v))](
        raw, targets, lse, ez if ez is not None else lse, g_lp, g_ent if g_ent is not None else g_lp, Vc, col0,
        raw.stride(0), 1.0 / temperature, HAS_ENT=g_ent is not None, BLOCK_V=block_v, num_warps=8)
    return raw

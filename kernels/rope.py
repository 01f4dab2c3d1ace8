"""Rotary position embedding on q and k, HF "rotate_half" layout (the engine's GPU path; the math is that of
`model.rope.apply_rotary`, which the model keeps using).

For x [T, H, D] with halves x1 = x[..., :D/2], x2 = x[..., D/2:] and cos/sin [T, D]:
  out[..., :D/2] = x1 * cos[:, :D/2] - x2 * sin[:, :D/2];  out[..., D/2:] = x2 * cos[:, D/2:] + x1 * sin[:, D/2:].
The reference computes in x's dtype op by op, exactly as the model does; the kernel computes in fp32 and rounds
once, so in bf16/fp16 the two may differ by an ulp.
`_rope_kernel`: grid (token, head tile); q and k are two launches of the same kernel.
"""
from __future__ import annotations

import torch

from kernels._triton import cdiv, lazy_jit, next_pow2, use_triton

tl = None  # triton.language, bound by lazy_jit at the first launch (see kernels/_triton.py)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D] -> rotated (q, k), new tensors."""
    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]
    return rotate(q), rotate(k)


@lazy_jit
def _rope_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, num_heads, stride_xt, stride_xh, stride_yt, stride_yh,
                 stride_ct, stride_st, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < HALF
    mask = (offs_h[:, None] < num_heads) & d_ok[None, :]
    c1 = tl.load(cos_ptr + t * stride_ct + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_st + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_st + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    x_off = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_off + HALF, mask=mask, other=0.0).to(tl.float32)
    y_off = y_ptr + t * stride_yt + offs_h[:, None] * stride_yh + offs_d[None, :]
    tl.store(y_off, (x1 * c1 - x2 * s1).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_off + HALF, (x2 * c2 + x1 * s2).to(y_ptr.dtype.element_ty), mask=mask)


def _rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool) -> torch.Tensor:
    T, H, D = x.shape
    assert D % 2 == 0 and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    y = x if inplace else torch.empty_like(x)
    if T == 0 or H == 0:
        return y
    block_half = next_pow2(D // 2)
    block_h = min(next_pow2(H), max(1, 1024 // block_half))
    _rope_kernel[(T, cdiv(H, block_h))](
        x, y, cos, sin, H, x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos.stride(0), sin.stride(0),
        HALF=D // 2, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4)
    return y


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rope_ref`; inplace=True overwrites q and k (and returns them)."""
    return _rope_one(q, cos, sin, inplace), _rope_one(k, cos, sin, inplace)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inplace: bool = False,
         impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: the Triton kernel on CUDA, the reference on CPU; impl "triton" / "ref" forces one. Forward only.
    inplace=True writes the result into q and k (both paths)."""
    if use_triton(impl, q, k, cos, sin):
        return rope_triton(q, k, cos, sin, inplace)
    qr, kr = rope_ref(q, k, cos, sin)
    if inplace:
        return q.copy_(qr), k.copy_(kr)
    return qr, kr

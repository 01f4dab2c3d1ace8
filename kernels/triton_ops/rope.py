"""Triton rotary embedding on q and k, HF "rotate_half" layout (contract and math: kernels.rope.rope_ref).

`_rope_kernel`: grid (token, head tile), fp32 inside and one rounding at the store; q and k are two launches of the
same kernel. BACKWARD rotates the other way (the gradient's rotation: the trainer's kernels/triton_ops/train.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, num_heads, stride_xt, stride_xh, stride_yt, stride_yh,
                 stride_ct, stride_st, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BACKWARD: tl.constexpr):
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
    if BACKWARD:  # the transpose of the forward's rotation: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
        tl.store(y_off, (x1 * c1 + x2 * s2).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_off + HALF, (x2 * c2 - x1 * s1).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_off, (x1 * c1 - x2 * s1).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_off + HALF, (x2 * c2 + x1 * s2).to(y_ptr.dtype.element_ty), mask=mask)


def _rope_one(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool, backward: bool = False
              ) -> torch.Tensor:
    T, H, D = x.shape
    assert D % 2 == 0 and x.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1
    y = x if inplace else torch.empty_like(x)
    if T == 0 or H == 0:
        return y
    block_half = triton.next_power_of_2(D // 2)
    block_h = min(triton.next_power_of_2(H), max(1, 1024 // block_half))
    _rope_kernel[(T, triton.cdiv(H, block_h))](
        x, y, cos, sin, H, x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos.stride(0), sin.stride(0),
        HALF=D // 2, BLOCK_H=block_h, BLOCK_HALF=block_half, BACKWARD=backward, num_warps=4)
    return y


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rope_ref`; inplace=True overwrites q and k (and returns them)."""
    return _rope_one(q, cos, sin, inplace), _rope_one(k, cos, sin, inplace)

"""Triton KV-cache write by slot mapping (contract: kernels.kv_cache.write_kv_ref).

`_write_kv_kernel`: grid (token, head tile); one program copies a [BLOCK_H, BLOCK_D] tile of one token's K and V
to cache slot `slot_mapping[t]` (block = slot // block_size, offset = slot % block_size), casting to the cache dtype;
slot -1 writes nothing. Strides are honoured, so k/v may be views into a fused qkv projection.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, num_heads,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h_ok = (offs_h < num_heads) & (tl.zeros_like(offs_h) + slot >= 0)  # slot -1: the whole row is masked off
    mask = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(kc_ptr + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :],
             k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :],
             v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Same contract as `write_kv_ref`. Needs unit stride on the last dim of every tensor."""
    T, H, D = k.shape
    if T == 0:
        return
    assert all(x.stride(-1) == 1 for x in (k, v, k_cache, v_cache)), "head_dim must be contiguous"
    assert slot_mapping.shape == (T,) and v.shape == k.shape
    block_d = triton.next_power_of_2(D)
    block_h = min(triton.next_power_of_2(H), max(1, 2048 // block_d))  # <= 2048 elements per program
    _write_kv_kernel[(T, triton.cdiv(H, block_h))](
        k, v, k_cache, v_cache, slot_mapping, H, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), HEAD_DIM=D, BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4)

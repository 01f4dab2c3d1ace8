"""Triton prefill / extend attention over the paged KV cache (contract: kernels.paged_prefill.paged_prefill_ref).

`_prefill_kernel` is a flash-attention loop over the block table: grid (sequence, kv head, query tile); each program
packs BLOCK_Q tokens x GROUP query heads of one KV head into BLOCK_M rows (so `tl.dot` has >= 16 rows and every K/V
tile loaded serves the whole GQA group), and walks K/V tiles from the window start to its last token with an online
(exp2) softmax. `load_kv_tile`, the paged K/V tile load, serves the decode kernel too (triton_ops/paged_attention.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import interpreting

LOG2E = 1.4426950408889634  # softmax in base 2: exp2(s * scale * LOG2E) == exp(s * scale)


@triton.jit
def load_kv_tile(k_ptr, v_ptr, bt_ptr, pos, pos_ok, offs_d, d_ok, stride_kb, stride_ks, stride_vb, stride_vs,
                 BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """K and V [len(pos), len(offs_d)] at sequence positions `pos` (zeros where ~pos_ok or ~d_ok). k_ptr / v_ptr
    point at one KV head of the caches, bt_ptr at the sequence's block table row. UPCAST: fp32 (the interpreter's
    bf16 tl.dot is wrong)."""
    blk = tl.load(bt_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    mask = pos_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + (blk * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + (blk * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, lens_ptr, bt_ptr, scale_log2, window,
                    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    stride_ot, stride_oh, stride_bt,
                    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                    USE_WINDOW: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """One (sequence, kv head, query tile): rows r = token (r // GROUP) x query head (r % GROUP) of the tile."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    tile_lo = tl.program_id(2) * BLOCK_Q
    q_start = tl.load(cu_q_ptr + b)
    m = tl.load(cu_q_ptr + b + 1) - q_start
    n = tl.load(lens_ptr + b)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = tile_lo + offs_m // GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < m)
    d_ok = offs_d < HEAD_DIM
    qpos = n - m + tok
    q_off = (q_start + tok).to(tl.int64) * stride_qt + (kvh * GROUP + offs_m % GROUP) * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter's bf16 tl.dot is wrong: compute in fp32 there
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)
    k_head, v_head, bt_row = k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, bt_ptr + b * stride_bt

    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(n - m + tile_lo - window + 1, 0)
    hi = tl.minimum(n, n - m + tile_lo + BLOCK_Q)
    hi = tl.where(tile_lo < m, hi, lo)  # a tile past this sequence's tokens does nothing

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + offs_n
        k_ok = kpos < hi
        k, v = load_kv_tile(k_head, v_head, bt_row, kpos, k_ok, offs_d, d_ok, stride_kb, stride_ks, stride_vb,
                            stride_vs, BLOCK_SIZE, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # base-2 softmax
        ok = row_ok[:, None] & k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if USE_WINDOW:
            ok = ok & (kpos[None, :] > qpos[:, None] - window)
        qk = tl.where(ok, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + tok).to(tl.int64) * stride_ot + (kvh * GROUP + offs_m % GROUP) * stride_oh
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def prefill_config(group: int, head_dim: int, interpret: bool) -> dict[str, int]:
    """Tile sizes and launch options of `_prefill_kernel`: BLOCK_M rows = BLOCK_Q tokens x GROUP heads. GPU values
    chosen from sm_90 compile statistics (no spills, 3-stage pipeline), not yet from timings."""
    block_m = max(32 if interpret else 64, triton.next_power_of_2(group))
    return dict(BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                BLOCK_N=16 if interpret else (64 if head_dim <= 64 else 32),
                num_warps=4 if interpret or head_dim <= 64 else 8, num_stages=1 if interpret else 3)


def paged_prefill_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                         window: int | None = None, max_seqlen_q: int | None = None) -> torch.Tensor:
    """Same contract as `paged_prefill_ref`. max_seqlen_q (longest new-token run) sizes the grid; computed from
    cu_seqlens_q (one host sync) when not given."""
    T, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    assert Hq % Hkv == 0 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    B = context_lens.shape[0]
    if B == 0 or T == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    group = Hq // Hkv
    interp = interpreting()
    cfg = prefill_config(group, D, interp)
    grid = (B, Hkv, triton.cdiv(max_seqlen_q, cfg["BLOCK_Q"]))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, scale * LOG2E, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, HEAD_DIM=D, BLOCK_SIZE=block_size, USE_WINDOW=window is not None, UPCAST=interp,
        DOT_PREC="ieee" if k_cache.dtype == torch.float32 else "tf32", **cfg)
    return out

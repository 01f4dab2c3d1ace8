"""Triton paged decode, flash-decoding style (contract: kernels.paged_attention.paged_decode_ref).

`_decode_kernel` runs on a grid (sequence, kv head, split): each program packs the GQA group's query heads into
BLOCK_H >= 16 rows (so `tl.dot` has a real M dimension and every K/V tile loaded from HBM serves the whole group),
walks its share of the sequence's KV positions through the block table in BLOCK_N-token tiles with an online (exp2)
softmax, and either writes the normalised output (one split) or a partial output plus its log-sum-exp;
`_reduce_kernel` then merges the splits. The number of splits comes from batch * kv_heads against the SM count and
an upper bound on the context length that needs no host sync (block_tables.shape[1] * block_size), so the launch can
be captured in a CUDA graph.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.dispatch import interpreting
from kernels.triton_ops.paged_prefill import LOG2E, load_kv_tile

MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost (partial write, reduce) outweighs its parallelism
MAX_SPLITS = 32


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr, scale_log2, window,
                   stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                   stride_bt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                   GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   USE_WINDOW: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """One (sequence b, kv head, split): attention of the group's query heads over positions [start, end)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(n - window, 0)
    chunk = tl.cdiv(tl.cdiv(n - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N  # whole tiles per split
    start = lo + split * chunk
    end = tl.minimum(start + chunk, n)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter's bf16 tl.dot is wrong: compute in fp32 there
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)
    k_head, v_head, bt_row = k_ptr + kvh * stride_kh, v_ptr + kvh * stride_vh, bt_ptr + b * stride_bt

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        n_ok = pos < end
        k, v = load_kv_tile(k_head, v_head, bt_row, pos, n_ok, offs_d, d_ok, stride_kb, stride_ks, stride_vb,
                            stride_vs, BLOCK_SIZE, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [BLOCK_H, BLOCK_N], base-2 softmax
        qk = tl.where(n_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: the tile holds at least one valid position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split (or context 0) gives zeros, not NaN
    mask = h_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        base = b.to(tl.int64) * stride_pb + split * stride_ps
        tl.store(part_ptr + base + heads[:, None] * stride_ph + offs_d[None, :], o, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=h_ok)


@triton.jit
def _reduce_kernel(part_ptr, lse_ptr, out_ptr, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                   stride_ob, stride_oh, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """One (sequence, query head): out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0))  # every split empty (context 0): all weights 0
    part = tl.load(part_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    den = tl.sum(w, 0)
    o = tl.sum(w[:, None] * part, 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (a nominal 132, an H100/H200, for CPU tensors: index -1)."""
    if device_index < 0 or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    return num_sms(t.device.index if t.is_cuda and t.device.index is not None else
                   (torch.cuda.current_device() if t.is_cuda else -1))


def choose_num_splits(batch: int, kv_heads: int, max_context: int, sms: int) -> int:
    """KV splits per sequence: enough programs for about two per SM when batch * kv_heads alone is too few, and no
    split shorter than MIN_TOKENS_PER_SPLIT tokens. A power of two, at most MAX_SPLITS."""
    programs = batch * kv_heads
    if programs >= 2 * sms:
        return 1
    want = min(triton.cdiv(2 * sms, max(programs, 1)), max_context // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    return 1 << (max(want, 1).bit_length() - 1)


def decode_config(group: int, head_dim: int, interpret: bool) -> dict[str, int]:
    """Tile sizes and launch options of `_decode_kernel`. GPU values chosen from sm_90 compile statistics (no
    spills, ~100 registers, 3-stage cp.async pipeline at D=128), not yet from timings; the interpreter gets small
    tiles so tiny test contexts still span several tiles."""
    return dict(BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                BLOCK_N=16 if interpret else 64, num_warps=4, num_stages=1 if interpret else 3)


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, window: int | None = None,
                        num_splits: int | None = None, max_context_len: int | None = None) -> torch.Tensor:
    """Same contract as `paged_decode_ref`. num_splits: force the KV split count (1: single pass, no reduce);
    max_context_len: a host-side bound on context_lens for the split heuristic (default: the block table's
    capacity, block_tables.shape[1] * block_size, which needs no device sync)."""
    B, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    assert Hq % Hkv == 0 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    if B == 0:
        return out
    group = Hq // Hkv
    bound = max_context_len if max_context_len is not None else block_tables.shape[1] * block_size
    if window is not None:
        bound = min(bound, window)
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, bound, device_sms(q))
    interp = interpreting()
    cfg = decode_config(group, D, interp)
    if num_splits > 1:
        part = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        part, lse = out, out  # unused by the single-pass variant
    _decode_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part, lse, scale * LOG2E, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0),
        out.stride(1), part.stride(0), part.stride(1), part.stride(-2), lse.stride(0), lse.stride(1),
        GROUP=group, HEAD_DIM=D, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits, USE_WINDOW=window is not None,
        UPCAST=interp, DOT_PREC="ieee" if k_cache.dtype == torch.float32 else "tf32", **cfg)
    if num_splits > 1:
        _reduce_kernel[(B, Hq)](
            part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            HEAD_DIM=D, BLOCK_D=cfg["BLOCK_D"], num_warps=4)
    return out

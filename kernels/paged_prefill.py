"""Prefill / extend attention over a paged prefix: the new tokens of each sequence attend causally to the whole
sequence (cached prefix + themselves), all of which is already in the paged KV cache.

Three implementations behind `paged_prefill` (re-exported by `kernels.paged_attention`, where the engine imports it):
- flash-attn's `flash_attn_varlen_func(..., block_table=...)` on CUDA when importable (fp16/bf16, and FA2's paged
  mode needs block_size % 256 == 0);
- `paged_prefill_triton` (kernels/triton_ops/paged_prefill.py), a Triton flash-attention loop over the block table
  with the GQA group packed into the rows of each `tl.dot`;
- `paged_prefill_ref`, plain PyTorch (gather + SDPA with an explicit mask): the CPU path and the oracle.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from kernels.dispatch import resolve_impl, use_triton

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, n: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n cached tokens of one sequence: [n, Hkv, D] each. block_table: [max_blocks] int (-1 padded)."""
    bs = k_cache.shape[1]
    blocks = block_table[: (n + bs - 1) // bs].long()
    k = k_cache[blocks].flatten(0, 1)[:n]
    v = v_cache[blocks].flatten(0, 1)[:n]
    return k, v


def paged_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      window: int | None = None) -> torch.Tensor:
    """Extend attention: q [Tq, Hq, D] holds the new tokens of B sequences (cu_seqlens_q [B+1]); each sequence's
    K/V, cached prefix and new tokens alike, is already in the paged cache, context_lens[b] tokens in all. New token
    i of sequence b sits at position context_lens[b] - q_len_b + i and attends causally to positions <= its own
    (and, with a window, > its own - window)."""
    out = torch.empty_like(q)
    for b, n in enumerate(context_lens.tolist()):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        m = e - s
        if m == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], n)
        qpos = torch.arange(n - m, n, device=q.device)[:, None]
        kpos = torch.arange(n, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1).float(), k.transpose(0, 1).float(),
                                           v.transpose(0, 1).float(), attn_mask=mask, scale=scale,
                                           enable_gqa=k.shape[1] != q.shape[1])
        out[s:e] = o.transpose(0, 1).to(q.dtype)
    return out


def _flash_ok(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (HAS_FLASH_ATTN and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and k_cache.dtype == q.dtype and k_cache.shape[1] % 256 == 0)


def paged_prefill_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                        window: int | None = None, max_seqlen_q: int | None = None) -> torch.Tensor:
    """flash-attn varlen over the paged cache (bottom-right-aligned causal mask == our positions)."""
    from flash_attn import flash_attn_varlen_func
    cu_k = F.pad(torch.cumsum(context_lens, 0, dtype=torch.int32), (1, 0))
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    return flash_attn_varlen_func(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q.to(torch.int32), cu_seqlens_k=cu_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=int(context_lens.max()), softmax_scale=scale, causal=True,
        window_size=(window - 1, 0) if window is not None else (-1, -1), block_table=block_tables.to(torch.int32))


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, window: int | None = None,
                  *, impl: str | None = None, max_seqlen_q: int | None = None) -> torch.Tensor:
    """Dispatcher (contract of `paged_prefill_ref`). impl "auto": flash-attn when importable and applicable, else
    the Triton kernel, on CUDA; the reference on CPU. "triton" / "ref" force one (see kernels/dispatch.py)."""
    if not use_triton(impl, q, k_cache, v_cache, block_tables):
        return paged_prefill_ref(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, window)
    if resolve_impl(impl) == "auto" and _flash_ok(q, k_cache):
        return paged_prefill_flash(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, window,
                                   max_seqlen_q)
    from kernels.triton_ops.paged_prefill import paged_prefill_triton
    return paged_prefill_triton(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, window,
                                max_seqlen_q)

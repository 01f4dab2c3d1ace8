"""Paged attention over the engine's KV pool: decode (one query token per sequence) and prefill/extend.

Reference implementations (plain PyTorch, used on CPU and as the test oracle); the Triton kernels and the
dispatcher live beside them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, n: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n cached tokens of one sequence: [n, Hkv, D] each. block_table: [max_blocks] int (-1 padded)."""
    bs = k_cache.shape[1]
    blocks = block_table[: (n + bs - 1) // bs].long()
    k = k_cache[blocks].flatten(0, 1)[:n]
    v = v_cache[blocks].flatten(0, 1)[:n]
    return k, v


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """q [B, Hq, D]; block_tables [B, max_blocks] int32; context_lens [B] (tokens in cache, including the
    current one, already written) -> out [B, Hq, D]. window: attend to the last `window` tokens only."""
    out = torch.empty_like(q)
    for b, n in enumerate(context_lens.tolist()):
        k, v = gather_kv(k_cache, v_cache, block_tables[b], n)
        if window is not None:
            k, v = k[-window:], v[-window:]
        o = F.scaled_dot_product_attention(q[b, :, None].float(), k.transpose(0, 1).float(),
                                           v.transpose(0, 1).float(), scale=scale,
                                           enable_gqa=k.shape[1] != q.shape[1])
        out[b] = o[:, 0].to(q.dtype)
    return out


def paged_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      window: int | None = None) -> torch.Tensor:
    """Extend attention: q [Tq, Hq, D] holds the new tokens of B sequences (cu_seqlens_q [B+1]); each sequence's
    K/V, cached prefix and new tokens alike, is already in the paged cache, context_lens[b] tokens in all. New token
    i of sequence b sits at position context_lens[b] - q_len_b + i and attends causally to positions <= its own."""
    out = torch.empty_like(q)
    for b, n in enumerate(context_lens.tolist()):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        m = e - s
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


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window=None):
    """Dispatcher (the Triton kernel on CUDA once it exists; the reference otherwise)."""
    return paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, window)


def paged_prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, window=None):
    return paged_prefill_ref(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, window)

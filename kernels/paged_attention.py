"""Paged attention over the engine's KV pool: decode (one query token per sequence) and prefill/extend.

Decode (this file): `paged_decode_ref` (plain PyTorch: gather + SDPA; the CPU path and the oracle) and the
dispatcher `paged_decode`. Its Triton side, a flash-decoding kernel with KV splits, is
kernels/triton_ops/paged_attention.py.

Prefill/extend lives in kernels/paged_prefill.py and is re-exported here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dispatch import use_triton
from kernels.paged_prefill import gather_kv, paged_prefill, paged_prefill_ref

__all__ = ["gather_kv", "paged_decode", "paged_decode_ref", "paged_prefill", "paged_prefill_ref"]


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """q [B, Hq, D]; block_tables [B, max_blocks] int32; context_lens [B] (tokens in cache, including the
    current one, already written) -> out [B, Hq, D]. window: attend to the last `window` tokens only.
    A sequence with context length 0 (a padding slot) gets zeros."""
    out = torch.zeros_like(q)
    for b, n in enumerate(context_lens.tolist()):
        if n == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], n)
        if window is not None:
            k, v = k[-window:], v[-window:]
        o = F.scaled_dot_product_attention(q[b, :, None].float(), k.transpose(0, 1).float(),
                                           v.transpose(0, 1).float(), scale=scale,
                                           enable_gqa=k.shape[1] != q.shape[1])
        out[b] = o[:, 0].to(q.dtype)
    return out


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None = None, *, impl: str | None = None,
                 num_splits: int | None = None, max_context_len: int | None = None) -> torch.Tensor:
    """Dispatcher (contract of `paged_decode_ref`): the Triton kernel on CUDA, the reference on CPU; impl
    "triton" / "ref" (or TIDAL_KERNELS) forces one (see kernels/dispatch.py). No host sync on the Triton path.
    num_splits, max_context_len: options of the Triton launch (`paged_decode_triton`); the reference ignores them."""
    if use_triton(impl, q, k_cache, v_cache, block_tables, context_lens):
        from kernels.triton_ops.paged_attention import paged_decode_triton
        return paged_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale, window,
                                   num_splits, max_context_len)
    return paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, window)

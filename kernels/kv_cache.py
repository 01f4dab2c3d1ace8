"""Write new tokens' K/V into the paged cache by slot mapping."""
from __future__ import annotations

import torch


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; slot_mapping [T] (slot -1: skip). In place."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Dispatcher (the Triton kernel on CUDA once it exists; the reference otherwise)."""
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)

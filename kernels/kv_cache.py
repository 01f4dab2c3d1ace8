"""Write new tokens' K/V into the paged cache by slot mapping (layout: kernels/__init__.py).

This file: the reference and the dispatcher; the Triton kernel is in kernels/triton_ops/kv_cache.py.
"""
from __future__ import annotations

import torch

from kernels.dispatch import use_triton


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; slot_mapping [T] (slot -1: skip). In place."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, impl: str | None = None) -> None:
    """Dispatcher: the Triton kernel on CUDA, the reference on CPU; impl "triton" / "ref" (or TIDAL_KERNELS)
    forces one (see kernels/dispatch.py). The Triton path never syncs with the host (CUDA-graph safe)."""
    if use_triton(impl, k, v, k_cache, v_cache, slot_mapping):
        from kernels.triton_ops.kv_cache import write_kv_triton
        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)

"""Attention backends: the one place where the trainer's and the engine's forward passes differ.

The model calls `backend(layer, q, k, v)` with packed (varlen) tensors: q [T, Hq, D], k/v [T, Hkv, D], where T is
the total number of new tokens of all sequences in the batch, and gets back [T, Hq, D]. What "causal" means is
the backend's business: `PackedCausal` attends within each packed sequence (training, parity tests); the engine's
paged backend (engine/attention.py) also attends to each sequence's cached prefix in the paged KV pool.
"""
from __future__ import annotations

import importlib.util
from typing import Protocol

import torch
import torch.nn.functional as F

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def cu_seqlens_from_lengths(lengths: list[int] | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.int32, device=device)
    return F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[0, 1, ..., n0-1, 0, 1, ..., n1-1, ...] for packed sequences."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    total = int(cu_seqlens[-1])
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths.long(), output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


class PackedCausal:
    """Causal self-attention within each of several sequences packed into one [T, ...] tensor.

    flash-attn's varlen kernel on CUDA when importable; otherwise the sequences are scattered into a padded
    [B, Lmax] batch for one causal SDPA call (B * Lmax^2 work, never more than a T x T mask) and gathered back.
    Padding sits after each sequence's last token, so causal masking keeps real tokens from seeing it.
    """

    def __init__(self, cu_seqlens: torch.Tensor, scale: float | None = None):
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        self.lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        self.max_seqlen = max(self.lengths) if self.lengths else 0
        self.scale = scale
        self._index: torch.Tensor | None = None

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str = "cpu") -> "PackedCausal":
        return cls(cu_seqlens_from_lengths(lengths, device))

    def _padded_index(self, device: torch.device) -> torch.Tensor:
        """Row of each packed token in the flattened [B * Lmax] padded batch."""
        if self._index is None:
            lengths = torch.tensor(self.lengths, device=device)
            seq = torch.repeat_interleave(torch.arange(len(self.lengths), device=device), lengths)
            pos = positions_from_cu_seqlens(self.cu_seqlens.to(device))
            self._index = seq * self.max_seqlen + pos
        return self._index

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        if HAS_FLASH_ATTN and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            from flash_attn import flash_attn_varlen_func
            cu = self.cu_seqlens.to(q.device)
            return flash_attn_varlen_func(q, k, v, cu, cu, self.max_seqlen, self.max_seqlen,
                                          softmax_scale=scale, causal=True)
        if len(self.lengths) == 1:
            return _sdpa(q, k, v, scale, is_causal=True)
        B, L = len(self.lengths), self.max_seqlen
        idx = self._padded_index(q.device)

        def pad(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
            return x.new_zeros(B * L, *x.shape[1:]).index_copy(0, idx, x).view(B, L, *x.shape[1:]).transpose(1, 2)

        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2).reshape(B * L, *q.shape[1:]).index_select(0, idx)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          is_causal: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H, D] in and out; GQA through SDPA's enable_gqa."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, is_causal=is_causal,
        scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(0, 1)

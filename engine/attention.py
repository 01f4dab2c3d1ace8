"""The engine's attention backend: write the step's new K/V into the paged pool, then attend over the pool.

The model calls `backend(layer, q, k, v)` with the step's packed tokens. The runner orders each batch so that the
sequences computing exactly one token (decodes) come first: those rows go through paged decode, the rest
(prefill chunks, recomputation after preemption) through paged prefill, both reading the whole context from the
pool, so a prefill chunk sees the sequence's earlier chunks and a fork sees its leader's prompt.

Which implementation: on CUDA the `kernels/` dispatchers (Triton). On CPU the kernels' references loop over
sequences in Python, which dominates a small model's step time, so CPU tensors go through the batched functions
below instead: gather every sequence's blocks into one padded tensor and make one SDPA call with a mask. Tests check
both against the kernels' references.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.kv_cache import write_kv
from kernels.paged_attention import paged_decode, paged_prefill


@dataclass
class AttentionMetadata:
    """Per-step tensors (on the model's device). Rows [0, num_decode) of the batch compute one token each."""
    slot_mapping: torch.Tensor  # [T] pool slot of each new token (-1: do not write)
    block_tables: torch.Tensor  # [B, W] int32, padded with 0
    context_lens: torch.Tensor  # [B] int32: tokens in the pool for each sequence after this step's write
    cu_seqlens_q: torch.Tensor  # [B - num_decode + 1] int32: prefill rows' new tokens, offsets from token num_decode
    num_decode: int
    max_context_len: int = 0  # host-side maxima for the CPU path (0 when unknown, e.g. under CUDA graphs)
    max_query_len: int = 0
    slots_valid: bool = False  # no -1 in slot_mapping (set by the runner's eager path): a plain index_copy_ writes
    # per query token (the runner's eager path): its batch row, and how many pool tokens it attends (position + 1)
    query_seq: torch.Tensor | None = None
    query_len: torch.Tensor | None = None


class PagedAttention:
    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], scale: float,
                 impl: str = "auto"):
        if impl not in ("auto", "kernels", "batched"):
            raise ValueError(f"attention impl must be auto, kernels or batched, got {impl!r}")
        self.k_caches, self.v_caches, self.scale = k_caches, v_caches, scale
        self.batched = impl == "batched" or (impl == "auto" and k_caches[0].device.type == "cpu")
        self.meta: AttentionMetadata | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m, kc, vc = self.meta, self.k_caches[layer], self.v_caches[layer]
        assert m is not None, "the runner sets .meta before each forward pass"
        self.write(m, kc, vc, k, v)
        nd, T = m.num_decode, q.shape[0]
        if nd == T:
            return self._decode(q, kc, vc, m.block_tables, m.context_lens)
        if nd == 0:
            return self._prefill(q, kc, vc, m.cu_seqlens_q, m.context_lens, m.block_tables)
        return torch.cat([
            self._decode(q[:nd], kc, vc, m.block_tables[:nd], m.context_lens[:nd]),
            self._prefill(q[nd:], kc, vc, m.cu_seqlens_q, m.context_lens[nd:], m.block_tables[nd:])])

    def write(self, m: AttentionMetadata, kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> None:
        """The step's new K/V into the layer's pool."""
        if self.batched and m.slots_valid:  # CPU: one index_copy_ per cache, no mask of -1 slots to apply
            kc.view(-1, *kc.shape[2:]).index_copy_(0, m.slot_mapping, k.to(kc.dtype))
            vc.view(-1, *vc.shape[2:]).index_copy_(0, m.slot_mapping, v.to(vc.dtype))
        else:
            write_kv(k, v, kc, vc, m.slot_mapping)

    def _decode(self, q, kc, vc, block_tables, context_lens):
        if self.batched:
            return batched_decode(q, kc, vc, block_tables, context_lens, self.scale, self.meta.max_context_len)
        return paged_decode(q, kc, vc, block_tables, context_lens, self.scale)

    def _prefill(self, q, kc, vc, cu_seqlens_q, context_lens, block_tables):
        if self.batched:
            return batched_prefill(q, kc, vc, cu_seqlens_q, context_lens, block_tables, self.scale,
                                   self.meta.max_context_len, self.meta.max_query_len)
        return paged_prefill(q, kc, vc, cu_seqlens_q, context_lens, block_tables, self.scale)


def _gather(kc: torch.Tensor, vc: torch.Tensor, block_tables: torch.Tensor, max_context_len: int):
    """Each sequence's first ceil(max_context_len / block_size) blocks, laid end to end: [B, L, Hkv, D] x 2."""
    if max_context_len <= 0:
        max_context_len = kc.shape[1] * block_tables.shape[1]
    nblk = min(-(-max_context_len // kc.shape[1]), block_tables.shape[1])
    idx = block_tables[:, :nblk].reshape(-1).long()
    shape = (block_tables.shape[0], nblk * kc.shape[1], *kc.shape[2:])
    # index_select on a 2-D view copies whole blocks; on the 4-D tensor it is several times slower on CPU
    return (kc.view(kc.shape[0], -1).index_select(0, idx).view(shape),
            vc.view(vc.shape[0], -1).index_select(0, idx).view(shape))


def batched_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, scale: float, max_context_len: int = 0, groups: int = 8,
                   min_group: int = 16) -> torch.Tensor:
    """Same contract as kernels.paged_attention.paged_decode_ref: q [B, Hq, D] -> [B, Hq, D]. On CPU a large batch
    is split into up to `groups` groups (of at least `min_group` sequences) of similar context length, each padded
    only to its own longest: the gather copies close to the sum of the context lengths, not B times the longest."""
    B = q.shape[0]
    groups = min(groups, B // min_group)
    if groups < 2 or q.device.type != "cpu":
        return _decode_padded(q, kc, vc, block_tables, context_lens, scale, max_context_len)
    order = context_lens.argsort()
    out = torch.empty_like(q)
    for idx in order.tensor_split(groups):
        out[idx] = _decode_padded(q[idx], kc, vc, block_tables[idx], context_lens[idx], scale,
                                  int(context_lens[idx[-1]]))
    return out


def _decode_padded(q, kc, vc, block_tables, context_lens, scale, max_context_len):
    k, v = _gather(kc, vc, block_tables, max_context_len)
    L = k.shape[1]
    mask = torch.arange(L, device=q.device)[None, :] < context_lens[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], scale=scale,
                                         enable_gqa=k.shape[2] != q.shape[1])
    return out[:, :, 0]


def batched_prefill(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    max_context_len: int = 0, max_query_len: int = 0) -> torch.Tensor:
    """Same contract as kernels.paged_attention.paged_prefill_ref: q [Tq, Hq, D] -> [Tq, Hq, D]. The B sequences'
    new tokens are padded to the longest (queries and keys both), attended in one SDPA call, and unpadded."""
    B, Tq = context_lens.shape[0], q.shape[0]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    if max_query_len <= 0:
        max_query_len = int(q_lens.max())
    k, v = _gather(kc, vc, block_tables, max_context_len)
    seq = torch.repeat_interleave(torch.arange(B, device=q.device), q_lens, output_size=Tq)
    local = torch.arange(Tq, device=q.device) - cu_seqlens_q[:-1].long()[seq]
    dest = seq * max_query_len + local
    qpad = q.new_zeros(B * max_query_len, *q.shape[1:]).index_copy_(0, dest, q).view(B, max_query_len, *q.shape[1:])
    qpos = (context_lens.long() - q_lens)[:, None] + torch.arange(max_query_len, device=q.device)[None, :]
    mask = torch.arange(k.shape[1], device=q.device)[None, None, :] <= qpos[:, :, None]  # [B, maxq, L]
    out = F.scaled_dot_product_attention(qpad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale, enable_gqa=k.shape[2] != q.shape[1])
    return out.transpose(1, 2).reshape(B * max_query_len, *q.shape[1:])[dest]

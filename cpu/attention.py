"""The engine's paged attention on the CPU in C (cpu/csrc/paged_attention.c), and the attention backend that uses it.

On CPU, PyTorch has no paged attention: the batched path (engine/attention.py) gathers every sequence's KV blocks
into a padded copy and masks the padding, so each decode step writes and re-reads the whole KV context. The C
kernel reads K/V in place through the block table instead (the same walk the Triton kernels do on GPU), one query
row at a time (each row attends up to its own position): decode rows, prefill chunks and mixed batches in one call.
Without a C compiler `native_available()` is False and the engine keeps the batched
PyTorch path, after one warning that says why. Tests check it against the kernels' references.
"""
from __future__ import annotations

import ctypes

import torch

from cpu.build import SOURCE, NativeLibrary
from engine.attention import AttentionMetadata, PagedAttention


class CpuPagedAttention(PagedAttention):
    """engine/attention.py's backend, with decode rows and prefill chunks through the C kernel: impl "native", or
    "auto" on CPU for fp32 caches when the kernel builds ("batched" and "kernels" as the core's)."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], scale: float,
                 impl: str = "auto"):
        super().__init__(k_caches, v_caches, scale, "batched" if impl == "native" else impl)
        cpu = k_caches[0].device.type == "cpu"
        self.native = impl == "native" or (impl == "auto" and cpu and k_caches[0].dtype == torch.float32
                                           and native_available())
        if impl == "native" and not native_available():
            raise RuntimeError(f"attention impl 'native': {unavailable_reason()}")

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m: AttentionMetadata | None = self.meta
        if not (self.native and m is not None and m.query_seq is not None):
            return super().__call__(layer, q, k, v)
        kc, vc = self.k_caches[layer], self.v_caches[layer]   # decode rows and prefill chunks alike, in one call
        self.write(m, kc, vc, k, v)
        return paged_attention_native(q, kc, vc, m.block_tables, m.query_seq, m.query_len, self.scale)

    def _decode(self, q, kc, vc, block_tables, context_lens):
        if self.native:
            return paged_decode_native(q, kc, vc, block_tables, context_lens, self.scale)
        return super()._decode(q, kc, vc, block_tables, context_lens)

    def _prefill(self, q, kc, vc, cu_seqlens_q, context_lens, block_tables):
        if self.native:
            return paged_prefill_native(q, kc, vc, cu_seqlens_q, context_lens, block_tables, self.scale)
        return super()._prefill(q, kc, vc, cu_seqlens_q, context_lens, block_tables)


PAGED = NativeLibrary(SOURCE, {"paged_attention_f32": (
    [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 7
    + [ctypes.c_float, ctypes.c_int], ctypes.c_int)}, "using the batched PyTorch path")


def native_available() -> bool:
    return PAGED.load() is not None


def unavailable_reason() -> str | None:
    PAGED.load()
    return PAGED.error


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the native kernel takes these tensors (fp32 on CPU, GQA group a whole number)."""
    return (q.device.type == "cpu" and k_cache.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype == torch.float32 and q.shape[1] % k_cache.shape[2] == 0)


def paged_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           row_seq: torch.Tensor, row_len: torch.Tensor, scale: float) -> torch.Tensor:
    """q [R, Hq, D] -> out [R, Hq, D]: row r attends over the first row_len[r] pool tokens of sequence row_seq[r]
    (a row of block_tables [S, W]). Raises on tensors it does not take and on sequence or block ids out of range."""
    lib = PAGED.require()
    if not supports(q, k_cache):
        raise ValueError(f"native paged attention needs fp32 CPU tensors and Hq % Hkv == 0, got q {q.dtype} "
                         f"{tuple(q.shape)} on {q.device}, cache {k_cache.dtype} {tuple(k_cache.shape)}")
    R, Hq, D = q.shape
    num_blocks, bs, Hkv, Dk = k_cache.shape
    if Dk != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"head_dim mismatch: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if row_seq.shape != (R,) or row_len.shape != (R,):
        raise ValueError(f"row_seq {tuple(row_seq.shape)} / row_len {tuple(row_len.shape)} must both be [{R}]")
    q = q.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    bt = block_tables.to(torch.int32).contiguous()
    seq = row_seq.to(torch.int32).contiguous()
    lens = row_len.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    rc = lib.paged_attention_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), bt.shape[1],
                                 seq.data_ptr(), lens.data_ptr(), out.data_ptr(), R, Hq, Hkv, D, bs, num_blocks,
                                 bt.shape[0], scale, torch.get_num_threads())
    if rc == -2:
        raise IndexError(f"native paged attention: a row names a sequence outside the {bt.shape[0]} rows of the "
                         f"block table, attends past its {bt.shape[1]} blocks, or reads a block outside the pool's "
                         f"{num_blocks}")
    if rc != 0:
        raise MemoryError("native paged attention: could not allocate its scratch memory")
    return out


def paged_decode_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The contract of kernels.paged_attention.paged_decode_ref (no sliding window): q [B, Hq, D], one query row
    per sequence attending over its context_lens[b] tokens."""
    return paged_attention_native(q, k_cache, v_cache, block_tables, torch.arange(q.shape[0]), context_lens, scale)


def paged_prefill_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """The contract of kernels.paged_attention.paged_prefill_ref (no sliding window): new token i of sequence b
    sits at position context_lens[b] - q_len_b + i and attends to the positions up to its own."""
    rows_seq, rows_len = prefill_rows(cu_seqlens_q, context_lens)
    return paged_attention_native(q, k_cache, v_cache, block_tables, rows_seq, rows_len, scale)


def prefill_rows(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, tokens attended) of every new token of a prefill batch, causal within each sequence."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    T = int(cu_seqlens_q[-1])
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens, output_size=T)
    local = torch.arange(T) - cu_seqlens_q[:-1].long()[seq]
    return seq, context_lens.long()[seq] - q_lens[seq] + local + 1

"""Runs one scheduled step on the model: batch tensors in, logits of the sequences that sample out.

Owns the KV pool (one [num_blocks, block_size, Hkv, D] K and V tensor per layer), sized from the config or from free
GPU memory, and a block-table tensor with one row per running seat, kept in sync incrementally (a sequence's row is
only rewritten from the first entry that changed). All batch tensors are built with a handful of vectorised ops on
the host and moved to the device once. Logits are computed only for the last token of sequences that sample. The
model's norms (with the residual adds), rotary embedding and SwiGLU run as one kernel each (engine/fused.py):
Triton on CUDA, or a registered family (cpu/'s C kernels on the CPU in fp32). On CUDA pure-decode steps replay CUDA
graphs captured per batch-size bucket (engine/cuda_graphs.py). A backend may subclass the runner (the optional
cpu/ package does, for its C forward), and `attention_class` is the attention backend it builds.
"""
from __future__ import annotations

import warnings
from typing import Iterable

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, PagedAttention
from engine.block_manager import cdiv
from engine.config import EngineConfig
from engine.fused import has_kernels, use_eager_ops, use_fused_ops
from engine.scheduler import ScheduledBatch
from kernels.dispatch import resolve_impl
from model.attention import PackedCausal
from model.transformer import Transformer

CPU_DEFAULT_POOL_BYTES = 1 << 30


class ModelRunner:
    attention_class: type[PagedAttention] = PagedAttention

    def __init__(self, model: Transformer, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device) if config.device is not None else next(model.parameters()).device
        self.dtype = config.dtype or next(model.parameters()).dtype
        self.model = model.to(self.device, self.dtype).eval()
        if config.fused_ops and (self.device.type == "cuda" or resolve_impl(None) == "triton"
                                 or has_kernels(self.device, self.dtype)):
            use_fused_ops(self.model)
        elif not config.fused_ops:  # the model may come from an engine that swapped it: eager, as configured
            use_eager_ops(self.model)
        cfg = model.config
        self.block_size = bs = config.block_size
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        self.num_blocks = self._pool_blocks(config)
        self.max_model_len = min(self.max_model_len, self.num_blocks * bs)
        self.max_blocks_per_seq = cdiv(self.max_model_len, bs)
        shape = (self.num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
        # zeros, not empty: masked-out garbage must be finite (0 * NaN would leak into SDPA's output)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        self.attn = self.attention_class(self.k_caches, self.v_caches, cfg.head_dim ** -0.5, config.attention)
        self.block_tables = torch.zeros(config.max_num_seqs, self.max_blocks_per_seq, dtype=torch.int32)
        self.graphs = None
        if self.device.type == "cuda" and config.cuda_graphs:
            from engine.cuda_graphs import DecodeGraphs
            try:
                self.graphs = DecodeGraphs(self, config.max_num_seqs)
            except Exception as e:  # e.g. a kernel that syncs with the host: run eagerly instead
                warnings.warn(f"CUDA graph capture failed, decode runs eagerly: {e}")
                self.graphs = None

    @property
    def block_bytes(self) -> int:
        cfg = self.model.config
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize

    def _pool_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_tokens is not None:
            return max(cdiv(config.num_kv_tokens, self.block_size), 1)
        if config.kv_cache_bytes is not None:
            return max(config.kv_cache_bytes // self.block_bytes, 1)
        if self.device.type != "cuda":
            want = cdiv(config.max_num_seqs * self.max_model_len, self.block_size)
            return max(min(want, CPU_DEFAULT_POOL_BYTES // self.block_bytes), 1)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():  # the largest step's activations: a max_batch_tokens prefill
            T = min(config.max_batch_tokens, self.max_model_len)
            ids = torch.zeros(T, dtype=torch.long, device=self.device)
            hidden = self.model(ids, torch.arange(T, device=self.device), PackedCausal.from_lengths([T], self.device))
            self.model.logits(hidden[:config.max_num_seqs])
            del hidden
        activations = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        n = int(free * config.memory_fraction - activations) // self.block_bytes
        if n < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache: {free / 2**30:.2f} GiB free, "
                               f"{activations / 2**30:.2f} GiB needed for activations")
        return n

    # ---- one step ---------------------------------------------------------------------------------------------
    def _sync_block_tables(self, seqs) -> torch.Tensor:
        """Copy the block-table entries added since the last step into the runner's table (one indexed write for
        the whole batch); the batch's seats."""
        seats = [s.seat for s in seqs]
        assert min(seats, default=0) >= 0, f"{next(s.request_id for s in seqs if s.seat < 0)} runs without a seat"
        rows: list[int] = []
        cols: list[int] = []
        blocks: list[int] = []
        for s in seqs:
            n = len(s.block_table)
            if s.table_synced < n:
                rows += [s.seat] * (n - s.table_synced)
                cols += range(s.table_synced, n)
                blocks += s.block_table[s.table_synced:]
                s.table_synced = n
        if blocks:
            self.block_tables[torch.tensor(rows), torch.tensor(cols)] = torch.tensor(blocks, dtype=torch.int32)
        return torch.tensor(seats, dtype=torch.long)

    def prepare(self, batch: ScheduledBatch, width: int | None = None):
        """Host-side batch tensors -> (input_ids, positions, metadata, logit_indices), all on the device."""
        seqs, ns, nd = batch.seqs, batch.num_tokens, batch.num_decode
        starts = [s.num_cached_tokens for s in seqs]
        ids = [s.token_ids[st] for s, st in zip(seqs[:nd], starts[:nd])]
        for s, st, n in zip(seqs[nd:], starts[nd:], ns[nd:]):
            ids += s.token_ids[st:st + n]
        seats = self._sync_block_tables(seqs)
        start_t = torch.tensor(starts, dtype=torch.long)
        one_each = len(ids) == len(seqs)  # every sequence computes one token (a decode step)
        n_t = None if one_each else torch.tensor(ns, dtype=torch.long)
        ctx = start_t + 1 if one_each else start_t + n_t
        max_ctx = max(starts) + 1 if one_each else max(s + n for s, n in zip(starts, ns))
        bt = self.block_tables[seats, :width or cdiv(max_ctx, self.block_size)]
        if one_each:
            owner, pos = torch.arange(len(seqs)), start_t
            cu = torch.arange(len(seqs) + 1)
        else:
            cu = F.pad(torch.cumsum(n_t, 0), (1, 0))
            owner = torch.repeat_interleave(torch.arange(len(seqs)), n_t, output_size=len(ids))
            pos = start_t[owner] + torch.arange(len(ids)) - cu[owner]
        slots = bt[owner, pos // self.block_size].long() * self.block_size + pos % self.block_size
        # logit rows ascend: as many as sequences means every row (a decode step's usual case: no index to build)
        logit_idx = owner if one_each and len(batch.logit_indices) == len(seqs) else (cu[1:] - 1)[batch.logit_indices]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev, non_blocking=True), block_tables=bt.to(dev, non_blocking=True),
            context_lens=ctx.to(dev, torch.int32, non_blocking=True),
            cu_seqlens_q=(cu[nd:] - nd).to(dev, torch.int32, non_blocking=True), num_decode=nd,
            max_context_len=max_ctx, max_query_len=1 if one_each else max(ns), slots_valid=True,
            query_seq=owner.to(dev, torch.int32, non_blocking=True),
            query_len=(ctx if one_each else pos + 1).to(dev, torch.int32, non_blocking=True))
        return (torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True), pos.to(dev, non_blocking=True),
                meta, logit_idx.to(dev, non_blocking=True))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits [len(batch.logit_indices), vocab] in the model's dtype (the sampler computes in fp32)."""
        if batch.copies:
            self.copy_blocks(batch.copies)
        decode_only = batch.num_decode == len(batch.seqs)
        if self.graphs is not None and decode_only and len(batch.seqs) <= self.graphs.max_bs:
            ids, pos, meta, logit_idx = self.prepare(batch, width=self.max_blocks_per_seq)
            logits = self.graphs.run(ids, pos, meta)
            # a decode step's rows all end a sequence's computed tokens: its logits rows are the batch's, in order
            return logits if len(batch.logit_indices) == len(batch.seqs) else logits[logit_idx]
        ids, pos, meta, logit_idx = self.prepare(batch)
        return self.forward(ids, pos, meta, logit_idx)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                logit_idx: torch.Tensor | None = None) -> torch.Tensor:
        self.attn.meta = meta
        hidden = self.model(ids, pos, self.attn)
        return self.model.logits(hidden if logit_idx is None else hidden[logit_idx])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for kc, vc in zip(self.k_caches, self.v_caches):
            kc[dst] = kc[src]
            vc[dst] = vc[src]

    # ---- a request's KV, out of the pool and into it ----------------------------------------------------------------
    def _slots(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        pos = torch.arange(num_tokens)
        table = torch.tensor(block_table, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    @torch.inference_mode()
    def read_kv(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """The K and V of the first `num_tokens` tokens held in `block_table`: one [2, layers, tokens, Hkv, D]
        tensor (a copy: only those tokens' slots, none of a shared or partly filled block's other slots)."""
        slots = self._slots(block_table, num_tokens)
        return torch.stack([torch.stack([c.flatten(0, 1)[slots] for c in caches])
                            for caches in (self.k_caches, self.v_caches)])

    @torch.inference_mode()
    def write_kv(self, block_table: list[int], kv: torch.Tensor) -> None:
        """Write `kv` ([2, layers, tokens, Hkv, D], as `read_kv` gives it) into the slots of `block_table`'s first
        tokens."""
        slots = self._slots(block_table, kv.shape[2])
        kv = kv.to(self.device)
        for i, (kc, vc) in enumerate(zip(self.k_caches, self.v_caches)):
            kc.flatten(0, 1)[slots] = kv[0, i]
            vc.flatten(0, 1)[slots] = kv[1, i]

    def kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        """The shape `read_kv` gives for `num_tokens` tokens."""
        cfg = self.model.config
        return (2, cfg.num_layers, num_tokens, cfg.num_kv_heads, cfg.head_dim)

    # ---- weights ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the model's parameters in place (so captured CUDA graphs stay valid). Returns the
        number of tensors loaded."""
        params = self.model.state_dict(keep_vars=True)
        items = weights.items() if isinstance(weights, dict) else weights
        n = 0
        for name, t in items:
            if name not in params:
                raise KeyError(f"load_weights: no parameter named {name!r} in the model")
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"load_weights: {name} has shape {tuple(t.shape)}, the model's is {tuple(p.shape)}")
            p.data.copy_(t)
            n += 1
        return n

"""CUDA graphs for decode steps: one graph per batch-size bucket, all sharing one memory pool.

A decode step computes one token for each of B sequences. Its inputs live in static buffers sized for the largest
bucket; a step copies its tensors into the first B rows, pads the rest (slot -1: write nothing; context 1: attend
to one harmless finite slot), replays the graph of the smallest bucket >= B and reads the first B rows of logits.
Block tables are full width (max_blocks_per_seq) so one graph serves every context length; attention kernels must
take their bounds from `context_lens`, never from the host, which is also what makes them capturable.
"""
from __future__ import annotations

import torch

from engine.attention import AttentionMetadata


class DecodeGraphs:
    def __init__(self, runner, max_bs: int):
        self.runner = runner
        dev = runner.device
        self.max_bs = max_bs
        self.buckets = sorted({b for b in (1, 2, 4, 8) if b < max_bs} | set(range(16, max_bs, 16)) | {max_bs})
        self.ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.pos = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.slots = torch.full((max_bs,), -1, dtype=torch.long, device=dev)
        self.ctx = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.bt = torch.zeros(max_bs, runner.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.buckets):  # largest first, so smaller graphs reuse its memory
                meta = self._meta(bs)
                runner.forward(self.ids[:bs], self.pos[:bs], meta)  # warm-up: kernel compilation, autotuning
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = runner.forward(self.ids[:bs], self.pos[:bs], meta)
                pool = graph.pool()
                self.graphs[bs] = (graph, out)
        torch.cuda.synchronize(dev)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slots[:bs], block_tables=self.bt[:bs], context_lens=self.ctx[:bs],
                                 cu_seqlens_q=self.ctx[:1], num_decode=bs)

    def run(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a decode step whose B <= max_bs inputs are given."""
        B = ids.shape[0]
        bs = next(b for b in self.buckets if b >= B)
        self.ids[:B].copy_(ids)
        self.pos[:B].copy_(pos)
        self.slots[:B].copy_(meta.slot_mapping)
        self.slots[B:bs].fill_(-1)
        self.ctx[:B].copy_(meta.context_lens)
        self.ctx[B:bs].fill_(1)
        self.bt[:B].copy_(meta.block_tables)
        graph, out = self.graphs[bs]
        graph.replay()
        self.num_replays += 1
        return out[:B]

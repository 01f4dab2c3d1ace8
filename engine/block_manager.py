"""Fixed-size KV blocks with reference counts: prefix sharing by fork, copy-on-write of the last partial block.

Pure bookkeeping over block ids; the runner owns the tensors. A GRPO group's G samples have the same prompt: the
scheduler prefills it once (the leader) and forks the others from it, so the prompt's blocks are held G times but
allocated once. The last prompt block is usually partly filled; the first sibling to write into it gets a private
copy (`allocate` returns the (src, dst) pair for the runner to copy), the last one writes in place.

The free blocks are taken lowest id first (a heap), so a round's sequences get their blocks in the order they
grow, whatever order earlier sequences freed theirs in: the blocks decode steps read one row after the other lie
side by side, where a free list in freeing order scattered them. On the CPU the paged attention of the long vs-TRL
round (256 sequences x 256 tokens, one thread) took 0.301-0.319 s against 0.340-0.379, the round 0.90-0.97 s
against 0.92-1.03 (bench/results/cpu-vs-trl.md): the hardware prefetcher follows a row's blocks into the next row's.

Invariant between steps: len(seq.block_table) == ceil(seq.num_cached_tokens / block_size).
"""
from __future__ import annotations

import heapq

from engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: list[int] = list(range(num_blocks))   # a min-heap (ascending: already one)

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def _needs_cow(self, seq: Sequence) -> bool:
        return bool(seq.num_cached_tokens % self.block_size) and self.ref_counts[seq.block_table[-1]] > 1

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks that computing `num_new_tokens` more tokens of `seq` takes (new blocks + a COW copy)."""
        grow = cdiv(seq.num_cached_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        return grow + self._needs_cow(seq)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, num_new_tokens) + reserve <= self.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for `num_new_tokens` more tokens of `seq`. Returns block copies [(src, dst)] to do first."""
        copies = []
        table = seq.block_table
        if self._needs_cow(seq):
            old, new = table[-1], self._take()
            self.ref_counts[old] -= 1
            table[-1] = new
            seq.table_synced = min(seq.table_synced, len(table) - 1)
            copies.append((old, new))
        for _ in range(cdiv(seq.num_cached_tokens + num_new_tokens, self.block_size) - len(table)):
            table.append(self._take())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks (which must hold the same tokens)."""
        assert not child.block_table, "fork into a sequence that holds blocks"
        for b in parent.block_table:
            self.ref_counts[b] += 1
        child.block_table = list(parent.block_table)
        child.table_synced = 0

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} freed more often than held"
            if self.ref_counts[b] == 0:
                heapq.heappush(self.free_ids, b)
        seq.block_table = []
        seq.table_synced = 0

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past those of `seq`'s cached tokens (allocated ahead for tokens never computed)."""
        keep = cdiv(seq.num_cached_tokens, self.block_size)
        for b in reversed(seq.block_table[keep:]):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                heapq.heappush(self.free_ids, b)
        del seq.block_table[keep:]
        seq.table_synced = min(seq.table_synced, keep)

    def hold(self, n: int) -> list[int]:
        """Take n free blocks out of circulation (KV kept outside the pool, counted against it), at most what is
        free."""
        return [self._take() for _ in range(min(n, self.num_free))]

    def release(self, ids: list[int]) -> None:
        for b in ids:
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] == 0, f"held block {b} was shared"
            heapq.heappush(self.free_ids, b)

    def _take(self) -> int:
        b = heapq.heappop(self.free_ids)  # callers check can_allocate first; an IndexError here is a scheduler bug
        assert self.ref_counts[b] == 0
        self.ref_counts[b] = 1
        return b

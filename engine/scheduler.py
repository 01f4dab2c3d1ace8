"""Continuous batching: which sequences compute how many tokens in the next step.

Every step takes the running sequences first, oldest first (a decoding one computes 1 token, one still prefilling a
long prompt takes a chunk of what is left of the token budget), then admits waiting ones in arrival order
(preempted sequences are at the front), each with a first prefill chunk. Prefill and decode share a step.
When the block pool runs dry the newest running sequence is preempted by recompute: its blocks are freed and it
goes back to the front of the waiting queue with its tokens, to be re-prefilled (prompt + generated) later.

Multi-turn requests (engine/turns.py): a request whose turn ended is `held`, out of the running set (its seat
free) with its blocks kept; extended, it waits again holding them and only its new tokens are prefilled. Kept KV
gives way first: when the pool runs dry, the KV of the request held longest (then of a waiting one, newest first) is
dropped before any running sequence is preempted or an admission refused; that request is recomputed when it runs.

GRPO groups: when a fresh request of group g is admitted, its waiting siblings with the same prompt attach to it as
`forks`; the prompt is prefilled once, and in the step that completes it every fork gets the leader's blocks
(shared, copy-on-write) and samples its first token from the leader's logits row with its own generator.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import RequestId, Sequence, SeqStatus


@dataclass
class EngineStats:
    """What an engine reports about itself."""
    version: int
    running: list[RequestId]  # request ids of sequences decoding or prefilling
    waiting: list[RequestId]  # request ids queued for (re-)prefill, next first
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    block_size: int
    num_tokens_decoded: int = 0  # tokens sampled since the engine started
    num_prefill_tokens: int = 0  # prompt / recomputed tokens run through the model
    num_steps: int = 0
    num_preemptions: int = 0
    time: float = 0.0
    held: list[RequestId] = field(default_factory=list)  # multi-turn requests between turns, held longest first
    num_evictions: int = 0  # kept KV of held or waiting requests dropped under memory pressure


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]  # sequences computing tokens this step; the `num_decode` one-token ones come first
    num_tokens: list[int]
    num_decode: int
    logit_indices: list[int]  # indices into seqs of those whose computed tokens reach their end: one logits row each
    sample_seqs: list[Sequence]  # sequences receiving a new token (includes forks, which have no row of their own)
    sample_rows: list[int]  # for each of sample_seqs, its row among the logits rows
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies (src, dst), do first

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_batch_tokens: int,
                 chunked_prefill: bool = True):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[RequestId, Sequence] = {}  # multi-turn requests between turns, held longest first
        self.free_seats = list(range(max_num_seqs - 1, -1, -1))
        self.watermark = self.bm.num_blocks // 100  # kept free when admitting next to running sequences
        self.num_preemptions = self.num_evictions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    # ---- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.max_batch_tokens
        chosen: list[tuple[Sequence, int]] = []
        copies: list[tuple[int, int]] = []
        forked: dict[int, list[Sequence]] = {}  # id(leader) -> forks created this step
        i, preempted = 0, False
        bs, refs = self.bm.block_size, self.bm.ref_counts
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            c = seq.num_cached_tokens
            if len(seq.token_ids) - c == 1 and c % bs and refs[seq.block_table[-1]] == 1 and not seq.forks:
                chosen.append((seq, 1))  # a decode into its own partly filled block: nothing to allocate
                budget -= 1
                i += 1
                continue
            n = min(seq.num_uncomputed, budget)
            while not self.bm.can_allocate(seq, n):
                if self.evict():
                    continue
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                copies += self._take(seq, n, chosen, forked)
                budget -= n
                i += 1
        for fs in forked.values():
            self.running += fs
        if budget > 0 and self.waiting and self.free_seats and not preempted:  # short of blocks: admit nobody
            budget = self._admit(budget, chosen, copies, forked)
        return self._batch(chosen, copies, forked)

    def _admit(self, budget: int, chosen: list, copies: list, forked: dict) -> int:
        for seq in list(self.waiting):
            if budget <= 0 or not self.free_seats:
                break
            if seq.status is not SeqStatus.WAITING or seq.leader is not None:
                continue  # a sibling that forked from a leader admitted above
            n = min(seq.num_uncomputed, budget)
            if n < seq.num_uncomputed and not self.chunked_prefill:
                break
            if 1 + len(seq.forks) > len(self.free_seats):
                break
            reserve = self.watermark if self.running else 0
            if not self._room(seq, n, reserve):
                break
            self.waiting.remove(seq)
            if seq.can_fork or seq.forks:
                self._gather_siblings(seq)
            seq.status = SeqStatus.RUNNING
            seq.seat = self.free_seats.pop()
            self.running.append(seq)
            copies += self._take(seq, n, chosen, forked)
            self.running += forked.get(id(seq), [])
            budget -= n
        return budget

    def _room(self, seq: Sequence, n: int, reserve: int) -> bool:
        """Whether `n` more tokens of `seq` fit with `reserve` blocks to spare, once kept KV has given way."""
        while not self.bm.can_allocate(seq, n, reserve):
            if not self.evict(keep=seq):
                return False
        return True

    def _gather_siblings(self, leader: Sequence) -> None:
        """Waiting group siblings with the same prompt fork from `leader` (as many as there are seats for)."""
        room = len(self.free_seats) - 1 - len(leader.forks)  # the caller checked that this is >= 0
        gid, found = leader.request.group_id, []
        for s in self.waiting if room > 0 else ():   # the group id first: the cheap test that rejects most
            if s.request.group_id == gid and s.leader is None and not s.forks and s.can_fork and leader.same_prompt(s):
                found.append(s)
                if len(found) == room:
                    break
        for s in found:
            self.waiting.remove(s)
            s.leader = leader
            leader.forks.append(s)
        for f in leader.forks:  # reserve their seats now; they start running when the prompt is done
            f.seat = self.free_seats.pop()

    def _take(self, seq: Sequence, n: int, chosen: list, forked: dict) -> list[tuple[int, int]]:
        copies = self.bm.allocate(seq, n)
        chosen.append((seq, n))
        if seq.num_cached_tokens + n == seq.num_tokens and seq.forks:
            for f in seq.forks:
                self.bm.fork(seq, f)
                f.num_cached_tokens = seq.num_cached_tokens + n
                f.leader = None
                f.status = SeqStatus.RUNNING
            forked[id(seq)] = seq.forks
            seq.forks = []
        return copies

    def _batch(self, chosen: list[tuple[Sequence, int]], copies: list, forked: dict) -> ScheduledBatch:
        if not forked and all(n == 1 and s.num_cached_tokens + 1 == len(s.token_ids) for s, n in chosen):
            # a pure decode step (the common one): every sequence computes its last token and samples, in order
            seqs, rows = [s for s, _ in chosen], list(range(len(chosen)))
            return ScheduledBatch(seqs, [1] * len(seqs), len(seqs), rows, list(seqs), list(rows), copies)
        order = [c for c in chosen if c[1] == 1] + [c for c in chosen if c[1] > 1]
        seqs, num_tokens = [c[0] for c in order], [c[1] for c in order]
        logit_indices, sample_seqs, sample_rows = [], [], []
        for i, (seq, n) in enumerate(order):
            if seq.num_cached_tokens + n == seq.num_tokens:
                row = len(logit_indices)
                logit_indices.append(i)
                for s in [seq] + forked.get(id(seq), []):
                    sample_seqs.append(s)
                    sample_rows.append(row)
        num_decode = sum(1 for n in num_tokens if n == 1)
        return ScheduledBatch(seqs, num_tokens, num_decode, logit_indices, sample_seqs, sample_rows, copies)

    def postprocess(self, batch: ScheduledBatch) -> None:
        """After the forward pass: the computed tokens' K/V are in the pool."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_cached_tokens += n

    def admit_cached(self, seq: Sequence, num_tokens: int) -> bool:
        """Move the waiting, fresh-imported `seq` straight into the running set with blocks for its first
        `num_tokens` tokens (whose K/V the caller writes, then marks cached), if a seat and the blocks (beyond the
        watermark kept free next to running sequences) are free; False (left waiting) otherwise."""
        assert seq.status is SeqStatus.WAITING and not seq.block_table and seq.num_cached_tokens == 0
        reserve = self.watermark if self.running else 0
        if not self.free_seats or not self.bm.can_allocate(seq, num_tokens, reserve):
            return False
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        seq.seat = self.free_seats.pop()
        self.running.append(seq)
        self.bm.allocate(seq, num_tokens)
        return True

    # ---- leaving the running set ----------------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.num_cached_tokens = 0
        if seq.seat >= 0:
            self.free_seats.append(seq.seat)
            seq.seat = -1

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED

    def preempt(self, seq: Sequence) -> None:
        """Recompute-preemption: free the blocks, requeue at the front with the tokens generated so far."""
        self.running.remove(seq)
        self._release(seq)
        for f in seq.forks:  # forks keep their reservation only while the leader runs
            self.free_seats.append(f.seat)
            f.seat = -1
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def preempt_all(self) -> None:
        """Every running sequence preempted, and the KV kept for held and waiting ones dropped: all recomputed."""
        for seq in reversed(list(self.running)):
            self.preempt(seq)
        for seq in [*self.held.values(), *self.waiting]:
            if seq.block_table and seq.leader is None:
                self._drop_kv(seq)

    # ---- multi-turn requests between turns ----------------------------------------------------------------------
    def hold(self, seq: Sequence) -> None:
        """A running multi-turn request's turn ended: out of the running set, its seat free, its blocks kept (those
        allocated ahead of its cached tokens given back)."""
        self.running.remove(seq)
        self.bm.trim(seq)
        if seq.seat >= 0:
            self.free_seats.append(seq.seat)
            seq.seat = -1
        seq.table_synced = 0   # the runner's block-table row was the seat's: its next seat's row is rewritten
        seq.status = SeqStatus.HELD
        self.held[seq.request_id] = seq

    def park(self, seq: Sequence, num_tokens: int) -> bool:
        """A fresh-imported `seq` exported while held is held here, with blocks for its first `num_tokens` tokens
        (whose K/V the caller writes, then marks cached) when they are free beyond the watermark; False: without."""
        self.waiting.remove(seq)
        seq.status = SeqStatus.HELD
        self.held[seq.request_id] = seq
        if num_tokens <= 0 or not self.bm.can_allocate(seq, num_tokens, self.watermark if self.running else 0):
            return False
        self.bm.allocate(seq, num_tokens)
        return True

    def unhold(self, seq: Sequence) -> None:
        """A held request was extended: it waits (at the back) with the blocks it kept."""
        del self.held[seq.request_id]
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def evict(self, keep: Sequence | None = None) -> bool:
        """Drop the kept KV of one request not running (but `keep`): the one held longest, else the newest waiting
        one; False when none keeps any."""
        for seq in self.held.values():
            if seq.block_table:
                self._drop_kv(seq)
                return True
        for seq in reversed(self.waiting):
            if seq.block_table and seq is not keep and seq.leader is None:
                self._drop_kv(seq)
                return True
        return False

    def _drop_kv(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.num_cached_tokens = 0
        self.num_evictions += 1

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the engine (abort / export) wherever it is. A leader hands its place to a fork."""
        if seq.leader is not None:  # a fork still waiting for its leader's prompt
            seq.leader.forks.remove(seq)
            seq.leader = None
            if seq.seat >= 0:
                self.free_seats.append(seq.seat)
                seq.seat = -1
        elif seq.forks:
            heir, rest = seq.forks[0], seq.forks[1:]
            heir.leader, heir.forks, heir.status = None, rest, seq.status
            for f in rest:
                f.leader = heir
            if seq.status is SeqStatus.RUNNING:  # the heir takes over the prompt prefilled so far, and the seat
                heir.block_table, heir.num_cached_tokens, heir.table_synced = seq.block_table, seq.num_cached_tokens, 0
                self.free_seats.append(heir.seat)
                heir.seat = seq.seat
                self.running[self.running.index(seq)] = heir
            else:
                self.waiting[self.waiting.index(seq)] = heir
            seq.block_table, seq.forks, seq.seat, seq.num_cached_tokens = [], [], -1, 0
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            self._release(seq)   # an extended multi-turn request waits with the blocks it kept
        elif seq.status is SeqStatus.HELD:
            del self.held[seq.request_id]
            self._release(seq)
        seq.status = SeqStatus.FINISHED

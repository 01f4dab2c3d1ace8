"""A simulated decode engine: continuous batching on a virtual clock, shaped like our engine/ (engine/scheduler.py).

Model, per engine step (every running sequence gets one token; step time from sim/cost.py):
  - admission, FIFO from the waiting queue, while a seat is free (`max_num_seqs`) and the KV blocks fit (keeping a 1%
    watermark free when others run, as engine/scheduler.py does); nobody is admitted in a step that preempted;
  - KV in fixed-size blocks; the G samples of a group resident on the engine share their prompt's full blocks
    (prefix sharing with copy-on-write of the partial last block), each sample owns the rest;
  - a newly admitted sequence's prefill (prompt + tokens it already had, i.e. recompute after a preemption) is paid
    in its first step, at `prefill_s_per_token`; a group sibling of a resident sequence skips the shared prompt;
  - when the running set needs more blocks than the pool holds, the most recently admitted sequence is preempted by
    recompute (blocks freed, back to the front of the queue with its tokens) until the rest fit.

Efficiency: between two events the running set is fixed, so the engine plans a *segment* of m steps at once, up to
the next finish or the step at which KV would overflow, and sums their time in closed form (kv grows by n per step).
Anything arriving mid-segment (a submit, a command) first brings the engine to the next step boundary (`sync`),
then the engine schedules the next segment. A running request's progress is lazy: it holds the engine step count
`mark` at which its `done` was last written, and every running request gains one token per engine step, so
advancing a segment touches no request; aggregates (context tokens, private KV blocks per residue of the block
size, the remaining-length heap) answer the planner in O(block_size) or O(log n). A request is brought up to date
(`_settle`) when it leaves the running set. 1024 engines x thousands of requests cost O(events x log running),
not O(tokens).

Partial trajectories: `remove` takes requests out with their state (tokens so far, per-token version runs) and `add`
accepts partially generated requests (their tokens are re-prefilled), so an interrupt is a remove, and a migration a
remove here and an add there; `hold` pauses decoding (weight loads, colocated training). A weight load on a busy
engine sends its running sequences back to the queue to re-prefill under the new version.

Multi-turn requests (sim/episodes.py; rl/env.py): a request whose model turn ends in a tool call leaves the running
set (its decode slot is free: it is not in the step's batch) but keeps its KV (`_held`: its private blocks and its
share of the prompt's count against the pool) while the call runs (`tools`); when the call returns (`observe`) its
observation tokens are appended under the engine's version and it goes to the front of the queue, and on admission
only the observation is prefilled (the history's KV is still there). What the rest does to it:
  - KV short (the running set outgrows the pool, or nothing runs and the queue's head does not fit): the KV held by
    requests not running is evicted first, the earliest held first, before any running request is preempted; an
    evicted request re-prefills prompt + tokens + observation when it runs again (counted as a preemption);
  - a weight load never cancels a call; a load that discards KV discards theirs too (they re-prefill under the new
    version when they run again, counted in `reprefill_s`), a keep-KV load leaves it;
  - remove (an Abort, an Interrupt, a migration's first half): taken out with its tokens so far, its turns done and
    its KV freed; the call in flight goes on but its result is dropped. The interrupted trajectory ends where its
    last model turn ended; resubmitted (`add`), a request whose last turn ended in a call makes the call again at
    once (the environment resumes from the transcript alone) and, holding no KV, prefills its history with the
    observation when the call returns;
  - a failed engine loses the calls it ran with everything else.

Faults (Laminar §3.3, §8.5; sim/backend.py `EngineFault`): with `stream`, a counters report the backend marks (and
the one an engine sends as it goes idle) carries every request whose tokens grew since it was last streamed, as a
partial-response pool chunk (sim/tokens.py `partial_chunk`); `fail` drops everything the engine holds (the tokens
since a request's last stream are lost, as on a dead GPU) and `recover` brings it back empty and without weights,
like a replacement machine.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Protocol, Sequence

from sched.events import Event
from sim.cost import CostModel
from sim.tokens import partial_chunk


_slot = attrgetter("slot")


@dataclass(eq=False, slots=True)  # identity equality: list.remove must not compare field by field
class SimRequest:
    req_id: int
    group_id: int
    sample_index: int
    prompt_index: int
    prompt_len: int
    target: int                     # response length this sample will have (from the workload)
    max_len: int                    # the response cap: reaching it means finish_reason "length"
    prompt_ids: Sequence[int] = ()
    round: int = 0                  # the controller's round (the backend's reward stage waits for a round's last)
    done: int = 0                   # response tokens generated so far
    runs: list[list[int]] = field(default_factory=list)  # [[version, tokens], ...] in generation order
    preemptions: int = 0
    prefill: int = 0                # tokens its next step must prefill (set on admission, 0 once computed)
    moved: bool = False             # its KV arrives over the interconnect (a migration) instead of a re-prefill
    reloaded: bool = False          # a weight load discarded its KV: its next prefill is partial rollout's re-prefill
    streamed: int = 0               # response tokens the controller's partial-response pool holds (`stream`)
    mark: int = 0                   # engine step count when `done` was last written (while running)
    slot: int = -1                  # admission number on its engine (running order; -1: not running)
    calls: tuple = ()               # multi-turn: its episode's tool calls (sim/episodes.py CallSpec), in order
    turn: int = 0                   # calls whose observation it holds (the model turn it is in, from 0)
    held_blocks: int = 0            # KV blocks it keeps while not running (on a tool, or back and queued); 0: none
    obs_new: int = 0                # observation tokens appended since its KV was last computed (to prefill)

    @property
    def stop(self) -> int:
        """Response tokens at which it next stops decoding: its next tool call, or the end of its episode."""
        return self.calls[self.turn].at if self.turn < len(self.calls) else self.target

    @property
    def at_call(self) -> bool:
        """Its last model turn ended in a tool call whose observation has not come back."""
        return self.turn < len(self.calls) and self.done == self.calls[self.turn].at

    def catch_up(self) -> None:
        """Set `turn` from `done` (a resumed trajectory: the calls whose observation it already holds)."""
        while self.turn < len(self.calls) and self.done >= self.calls[self.turn].at + self.calls[self.turn].obs:
            self.turn += 1

    def add_tokens(self, version: int, k: int) -> None:
        if self.runs and self.runs[-1][0] == version:
            self.runs[-1][1] += k
        else:
            self.runs.append([version, k])


class EngineHost(Protocol):
    """What an engine needs from the backend that owns the clock."""

    def emit(self, ev: Event) -> None: ...
    def wake(self, engine: int, t: float, gen: int) -> None: ...
    def finished(self, engine: int, req: SimRequest, t: float) -> None: ...
    def tool_started(self, engine: int, req: SimRequest, t: float) -> None: ...


@dataclass(slots=True)
class _Segment:
    start: float
    prefill_s: float
    n: int
    kv0: int
    m: int

    def boundary(self, cost: CostModel, j: int) -> float:
        """Time of the end of step j of this segment (the first step carries the prefill)."""
        return self.start if j <= 0 else self.start + self.prefill_s + cost.steps_s(self.n, self.kv0, j)


class SimEngine:
    def __init__(self, index: int, rank: int, cost: CostModel, host: EngineHost,
                 counters_every_s: float | None = None, progress: bool = False, stream: bool = False,
                 multi_turn: bool = False):
        self.index, self.rank, self.cost, self.host = index, rank, cost, host
        self.counters_every_s, self.progress, self.stream = counters_every_s, progress, stream
        self.multi_turn = multi_turn  # its counters report requests on tools (`tools`)
        self.tools: dict[int, SimRequest] = {}   # req_id -> request waiting on a tool call (not decoding)
        self._held: dict[int, SimRequest] = {}   # req_id -> request not running that keeps its KV, in holding order
        self._held_blocks = 0         # their private KV blocks (their prompts' shared blocks: `group_ref`)
        self.failed = False           # between `fail` and `recover`: holds nothing, decodes nothing
        self.bs, self.cap = cost.block_size, cost.kv_capacity_blocks
        self._running: dict[int, SimRequest] = {}  # slot -> request, in admission order
        self._base: dict[int, int] = {}   # req_id -> done - mark of each running request (fixed while it runs), in
        #                                   admission order: its tokens at engine step k are base + k
        self._slots = 0
        self._heap: list[tuple[int, int, SimRequest]] = []  # (finish step, slot, request); stale entries skipped
        self._q_sum = 0               # private blocks: sum of Q_r, plus per residue M_r the count of requests
        self._m_count = [0] * cost.block_size  # (b_r = prompt_len % bs + done - mark = Q_r * bs + M_r)
        self._m_suffix: list[int] | None = None  # suffix sums of _m_count (`need`), rebuilt after it changes
        self._kv_base = 0             # kv_tokens = _kv_base + len(running) * steps
        self._prefill = 0             # prefill tokens of the requests admitted since the last step
        self._moved = 0               # of which moved in (KV transferred, cost.kv_move_s), not recomputed
        self._reloaded = 0            # of which recompute KV a weight load discarded (`reprefill_s`)
        self.waiting: deque[SimRequest] = deque()
        self.version = -1
        self.t = 0.0                  # the state is exact at this instant
        self.seg: _Segment | None = None
        self.gen = 0                  # bumps whenever a planned wake-up becomes stale
        self.hold_until = -math.inf   # no decoding before this (weight load, colocated training)
        self.pending_version: int | None = None
        self.pending_keep_kv = False  # the pending load keeps the running sequences' KV (LoadWeights.keep_kv)
        self.busy = False
        self.group_ref: dict[int, int] = {}  # group id -> running members sharing its prompt blocks
        self.shared_blocks = 0
        self.tokens_total = 0
        self._tokens_reported = 0
        self.preemptions = 0
        self.prefill_s_total = 0.0    # seconds of prefill planned (recompute after preemption, load or resume included)
        self.reprefill_s = 0.0        # seconds of prefill run to recompute KV a weight load discarded (partial
        #                               rollout's re-prefill, Laminar §2.3)
        self.peak_blocks = 0
        self.steps = 0

    # ------------------------------------------------------------------------------------------- running set
    @property
    def running(self) -> list[SimRequest]:
        """The running requests in admission order (progress up to date only after `_settle`)."""
        return list(self._running.values())

    @property
    def kv_tokens(self) -> int:
        """Context tokens of the running set (what attention reads)."""
        return self._kv_base + len(self._running) * self.steps

    def done_of(self, r: SimRequest) -> int:
        """Response tokens r has now (running or not)."""
        return r.done + (self.steps - r.mark if r.slot >= 0 else 0)

    def _settle(self, r: SimRequest) -> None:
        """Write a running request's lazy progress into `done` and its version runs."""
        k = self.steps - r.mark
        if k > 0:
            r.done += k
            r.add_tokens(self.version, k)
            r.prefill = 0
            r.reloaded = False
            r.obs_new = 0
        r.mark = self.steps

    # ------------------------------------------------------------------------------------------------ KV blocks
    def _private(self, r: SimRequest, j: int) -> int:
        return -(-(r.prompt_len % self.bs + self.done_of(r) + j) // self.bs)

    def need(self, j: int = 0) -> int:
        """Blocks the running set needs to run its (j+1)-th step from now: shared prompt blocks plus, per request,
        ceil((b_r + steps + j) / bs) = Q_r + ceil((M_r + steps + j) / bs)."""
        bs = self.bs
        suf = self._m_suffix
        if suf is None:
            suf = [0] * (bs + 1)
            for m in range(bs - 1, -1, -1):
                suf[m] = suf[m + 1] + self._m_count[m]
            self._m_suffix = suf
        # ceil((m + q bs + r) / bs) = q + (0 if m + r == 0, 1 if m + r <= bs, else 2), summed over the residues m
        q, r = divmod(self.steps + j, bs)
        n = suf[0]
        return (self.shared_blocks + self._held_blocks + self._q_sum + q * n + n - (self._m_count[0] if r == 0 else 0)
                + (suf[bs - r + 1] if r else 0))

    def overflows_within(self, m: int) -> bool:
        """Whether the running set outgrows the pool within its next m steps."""
        return self.need(m - 1) > self.cap

    def fits_alone(self, r: SimRequest) -> bool:
        return r.prompt_len // self.bs + -(-(r.prompt_len % self.bs + r.max_len) // self.bs) <= self.cap

    def _attach(self, r: SimRequest) -> None:
        r.slot, r.mark = self._slots, self.steps
        self._slots += 1
        self._running[r.slot] = r
        self._base[r.req_id] = r.done - r.mark
        if self.group_ref.get(r.group_id, 0) == 0:
            self.shared_blocks += r.prompt_len // self.bs
        self.group_ref[r.group_id] = self.group_ref.get(r.group_id, 0) + 1
        b = r.prompt_len % self.bs + r.done - r.mark
        self._q_sum += b // self.bs
        self._m_count[b % self.bs] += 1
        self._m_suffix = None
        self._kv_base += r.prompt_len + r.done - r.mark
        heapq.heappush(self._heap, (r.mark + r.stop - r.done, r.slot, r))

    def _detach(self, r: SimRequest) -> None:
        """Take r out of the running set, its progress settled (its heap entry goes stale: slot -1)."""
        self._settle(r)
        del self._running[r.slot]
        del self._base[r.req_id]
        if r.prefill and self._prefill:
            self._prefill -= r.prefill
            if r.moved:
                self._moved -= r.prefill - r.obs_new
            if r.reloaded:
                self._reloaded -= r.prefill - r.obs_new
        r.moved = False
        r.slot = -1
        self._unshare(r)
        b = r.prompt_len % self.bs + r.done - r.mark
        self._q_sum -= b // self.bs
        self._m_count[b % self.bs] -= 1
        self._m_suffix = None
        self._kv_base -= r.prompt_len + r.done - r.mark

    def _unshare(self, r: SimRequest) -> None:
        """r no longer holds its share of its group's prompt blocks (the last one out frees them)."""
        left = self.group_ref[r.group_id] - 1
        if left == 0:
            del self.group_ref[r.group_id]
            self.shared_blocks -= r.prompt_len // self.bs
        else:
            self.group_ref[r.group_id] = left

    # ------------------------------------------------------------------------------------- multi-turn requests
    def _hold_kv(self, r: SimRequest) -> None:
        """r (not running) keeps its KV: its private blocks, and its share of its prompt's blocks."""
        r.held_blocks = -(-(r.prompt_len % self.bs + r.done) // self.bs)
        self._held[r.req_id] = r
        self._held_blocks += r.held_blocks
        if self.group_ref.get(r.group_id, 0) == 0:
            self.shared_blocks += r.prompt_len // self.bs
        self.group_ref[r.group_id] = self.group_ref.get(r.group_id, 0) + 1

    def _release_kv(self, r: SimRequest) -> None:
        del self._held[r.req_id]
        self._held_blocks -= r.held_blocks
        r.held_blocks = 0
        self._unshare(r)

    def _evict(self, r: SimRequest) -> None:
        """Free the KV r holds while not running (a preemption by recompute: it re-prefills when admitted)."""
        self._release_kv(r)
        r.preemptions += 1
        self.preemptions += 1

    def _evict_for(self, r: SimRequest) -> bool:
        """Nothing runs and r does not fit: evict the KV of a request not running (the earliest held, r last);
        whether one was evicted."""
        for q in self._held.values():
            if q is not r:
                self._evict(q)
                return True
        if r.req_id in self._held:
            self._evict(r)
            return True
        return False

    def _to_tool(self, r: SimRequest, keep_kv: bool) -> None:
        """r's model turn ended in a tool call: its decode slot is free; its KV stays (`keep_kv`) until it runs
        again, unless the pool runs short (`_preempt_to_fit`)."""
        self.tools[r.req_id] = r
        if keep_kv:
            self._hold_kv(r)
        self.host.tool_started(self.index, r, self.t)

    def tool_returned(self, r: SimRequest, now: float) -> bool:
        """r's tool call returned at `now`: whether r still waits on it here (else it was aborted, interrupted or
        lost with the engine, and the result is dropped). The caller then emits tool_finished and calls `observe`."""
        if self.tools.get(r.req_id) is not r:
            return False
        self.sync(now)
        del self.tools[r.req_id]
        return True

    def observe(self, r: SimRequest) -> None:
        """Append r's observation under the engine's version; r ends there if it reached its length (the cap), else
        goes to the front of the queue (it holds KV, as a preempted request does) to prefill the observation."""
        c = r.calls[r.turn]
        r.add_tokens(self.version, c.obs)
        r.done += c.obs
        r.turn += 1
        if r.done >= r.target:
            if r.req_id in self._held:
                self._release_kv(r)
            self.host.finished(self.index, r, self.t)
        else:
            r.obs_new += c.obs
            self.waiting.appendleft(r)
        self.schedule_segment()

    def _min_remaining(self) -> int:
        heap = self._heap
        while heap and heap[0][2].slot != heap[0][1]:
            heapq.heappop(heap)
        return heap[0][0] - self.steps

    # --------------------------------------------------------------------------------------------- the clock
    def sync(self, now: float) -> None:
        """Bring the state to the first step boundary at or after `now`: changes take effect between steps."""
        seg = self.seg
        if seg is None:
            self.t = max(self.t, now)
            return
        elapsed = now - seg.start
        j = 0 if elapsed <= 0 else max(1, self.cost.steps_reaching(seg.n, seg.kv0, elapsed - seg.prefill_s))
        j = min(j, seg.m)
        self._advance(j)
        self.t = seg.boundary(self.cost, j)
        self.seg = None
        self.gen += 1
        if j == seg.m:
            self._finish_done()

    def _advance(self, j: int) -> None:
        if j <= 0:
            return
        self.tokens_total += len(self._running) * j
        self.steps += j
        self.reprefill_s += self.cost.prefill_s(self._reloaded)   # the segment's first step ran the prefill
        self._prefill = self._moved = self._reloaded = 0

    def _finish_done(self) -> None:
        heap, done = self._heap, []
        while heap and heap[0][0] <= self.steps:
            _, slot, r = heapq.heappop(heap)
            if r.slot == slot:
                done.append(r)
        if len(done) > 1:
            done.sort(key=_slot)                  # in running (admission) order
        for r in done:
            self._detach(r)
            if r.calls and r.at_call:
                self._to_tool(r, keep_kv=True)
            else:
                self.host.finished(self.index, r, self.t)

    def on_wake(self, t: float, gen: int) -> None:
        if gen != self.gen:
            return  # superseded by a sync
        if self.seg is not None:
            self._advance(self.seg.m)
            self.seg = None
            self.t = t
            self._finish_done()
        self.t = max(self.t, t)
        if self.t >= self.hold_until and self.pending_version is not None:
            # As engine/engine.py load_weights: no KV computed by the old weights is read again; running sequences
            # go back to the front of the queue (progress settled under the old version) and re-prefill prompt +
            # tokens so far under the new one. A keep-KV load (PipelineRL's in-flight update) leaves them running
            # on their KV: their progress is settled under the old version, their next tokens count the new one.
            # Requests not running keep their tool calls going either way; a load that discards KV discards theirs
            # too (they re-prefill under the new version when they run again).
            running = len(self._running)
            if self.pending_keep_kv:
                for r in self.running:
                    self._settle(r)
            else:
                for r in reversed(self.running):
                    self._detach(r)
                    r.reloaded = True
                    self.waiting.appendleft(r)
                for r in list(self._held.values()):
                    self._release_kv(r)
                    r.reloaded = True
            self.version, self.pending_version = self.pending_version, None
            self.pending_keep_kv = False
            self.host.emit(Event("weights_loaded", self.t, rank=self.rank, engine=self.index, version=self.version,
                                 data={"running": running, "kept_kv": len(self._running)}))
        self.schedule_segment()

    # ------------------------------------------------------------------------------------------------ planning
    def schedule_segment(self) -> None:
        """Decide the next segment of steps from the current (synced) state and schedule its end."""
        if self.seg is not None:
            return
        self.gen += 1
        if self.t < self.hold_until:
            if self.hold_until < math.inf:    # held for good (lent to the trainer) until `release`
                self.host.wake(self.index, self.hold_until, self.gen)
            return
        if not self._preempt_to_fit():
            self._admit()
        if not self._running:
            self._set_busy(False)
            return
        self._set_busy(True)
        n = len(self._running)
        m = self._min_remaining()
        peak = self.need(m - 1)
        if peak > self.cap:           # KV overflows inside the segment (overflows_within): stop at the last step
            lo, hi = 0, m - 1            # that fits; need(lo) <= cap < need(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self.need(mid) <= self.cap else (lo, mid)
            m = lo + 1
            peak = self.need(lo)
        # admitted since the last step: recomputed, or (a migrated trajectory's) KV moved over the interconnect
        prefill_s = self.cost.prefill_s(self._prefill - self._moved) + self.cost.kv_move_s(self._moved)
        self.prefill_s_total += prefill_s
        self.peak_blocks = max(self.peak_blocks, peak)
        self.seg = _Segment(self.t, prefill_s, n, self.kv_tokens, m)
        self.host.wake(self.index, self.seg.boundary(self.cost, m), self.gen)

    def _preempt_to_fit(self) -> bool:
        preempted = False
        while (self._running or self._held) and self.need(0) > self.cap:
            if self._held:     # KV of requests not decoding goes first, the earliest held first (a long-tailed
                self._evict(next(iter(self._held.values())))   # call that has waited longest waits longest more)
                preempted = True
                continue
            victim = self._running[next(reversed(self._running))]
            self._detach(victim)
            victim.preemptions += 1
            self.preemptions += 1
            self.waiting.appendleft(victim)
            preempted = True
        return preempted

    def _admit(self) -> None:
        """FIFO admission; each admitted request's first step prefills its prompt (unless a resident sibling
        holds it) and the tokens it already had (recompute after a preemption)."""
        if not self.waiting:
            return
        need0, watermark = self.need(0), self.cap // 100
        while self.waiting and len(self._running) < self.cost.max_num_seqs:
            r = self.waiting[0]
            held = bool(self._held) and r.req_id in self._held   # back from a tool with its KV
            if held:
                resident, extra = True, self._private(r, 0) - r.held_blocks
            else:
                resident = self.group_ref.get(r.group_id, 0) > 0
                extra = (0 if resident else r.prompt_len // self.bs) + self._private(r, 0)
            if need0 + extra + (watermark if self._running else 0) > self.cap:
                if not self._running and self._held and self._evict_for(r):   # else nothing could ever run
                    need0 = self.need(0)
                    continue
                break
            self.waiting.popleft()
            if held:
                self._release_kv(r)
            self._attach(r)
            need0 += extra
            r.prefill = r.obs_new if held else (r.prompt_len % self.bs if resident else r.prompt_len) + r.done
            self._prefill += r.prefill
            if r.moved:
                self._moved += r.prefill - r.obs_new
            elif r.reloaded:
                self._reloaded += r.prefill - r.obs_new

    def _set_busy(self, busy: bool) -> None:
        if busy != self.busy:
            self.busy = busy
            self.host.emit(Event("engine_busy" if busy else "engine_idle", self.t, rank=self.rank, engine=self.index,
                                 version=self.version))
            if not busy and self.counters_every_s is not None:
                self.counters(stream=self.stream)

    def steps_by(self, now: float) -> int:
        """Steps of the current segment completed by `now` (0 without a segment): the state a report at `now` sees,
        read without ending the segment."""
        seg = self.seg
        if seg is None:
            return 0
        dt = now - seg.start - seg.prefill_s
        j = self.cost.steps_reaching(seg.n, seg.kv0, dt)
        if j > 0 and self.cost.steps_s(seg.n, seg.kv0, j) > dt + 1e-12:
            j -= 1
        return max(0, min(j, seg.m))

    def counters(self, now: float | None = None, stream: bool = False) -> None:
        """A tokens_decoded event with the engine's counters (as the runtime's rollout worker sends), as of the
        last step boundary by `now` (default: the engine's exact instant); a mid-segment report leaves the
        segment running. `stream`: with the requests' partial trajectories (`partials`)."""
        j = 0 if now is None else self.steps_by(now)
        total, used = self.tokens_total + len(self._running) * j, self.need(j)
        data: dict[str, Any] = {
            "tokens": total - self._tokens_reported, "total": total,
            "running": len(self._running), "waiting": len(self.waiting), "kv_used": used,
            "kv_free": self.cap - used, "preemptions": self.preemptions}
        if self.multi_turn:
            data["tools"] = len(self.tools)
        if self.progress:
            at = self.steps + j                 # done_of(r) + j, from `_base` (every running request, every report)
            progress = {rid: base + at for rid, base in self._base.items()}
            progress.update((r.req_id, r.done) for r in self.waiting)
            progress.update((r.req_id, r.done) for r in self.tools.values())
            data["progress"] = progress
        self._tokens_reported = total
        self.host.emit(Event("tokens_decoded", self.t if now is None else now, rank=self.rank, engine=self.index,
                             version=self.version, data=data,
                             payload={"partials": self.partials(self.steps + j)} if stream else None))

    def partials(self, at: int) -> dict[int, tuple]:
        """Every request whose tokens grew since it was last streamed, as of engine step `at`: its whole trajectory
        so far (the runtime's rollout worker streams the same, from the last streamed index)."""
        out = {}
        for r in self._running.values():
            k = at - r.mark
            if r.done + k > r.streamed:
                out[r.req_id] = partial_chunk(r.done, r.runs, self.version, k)
                r.streamed = r.done + k
        for r in itertools.chain(self.waiting, self.tools.values()):
            if r.done > r.streamed:
                out[r.req_id] = partial_chunk(r.done, r.runs, self.version, 0)
                r.streamed = r.done
        return out

    def fail(self, now: float) -> list[SimRequest]:
        """The engine dies at the step boundary by `now`: every request it held, with the tokens it had (for the
        report; what was not streamed is lost), and nothing more from it until `recover`."""
        self.sync(now)
        held = self.running
        for r in held:
            self._detach(r)
        held += self.waiting
        held += self.tools.values()       # their calls' results are lost with the engine
        for r in list(self._held.values()):
            self._release_kv(r)
        self.waiting.clear()
        self.tools.clear()
        self.failed, self.hold_until, self.pending_version = True, math.inf, None
        self.gen += 1
        if self.busy:   # no counters report: a dead engine streams nothing more
            self.busy = False
            self.host.emit(Event("engine_idle", self.t, rank=self.rank, engine=self.index, version=self.version))
        return held

    def recover(self, now: float) -> None:
        """Back, empty and without weights (a replacement machine: it loads the latest version when told)."""
        self.sync(now)
        self.failed, self.version, self.hold_until = False, -1, self.t
        self.schedule_segment()

    # ----------------------------------------------------------------------------------------- external calls
    def add(self, reqs: list[SimRequest], now: float) -> None:
        """Queue requests (fresh, or partially generated: their tokens so far are re-prefilled)."""
        for r in reqs:
            if not self.fits_alone(r):
                raise ValueError(f"engine {self.index}: request {r.req_id} (prompt {r.prompt_len} + up to {r.max_len} "
                                 f"response tokens) cannot fit in the KV pool of {self.cap} blocks x {self.bs} tokens "
                                 f"(cost profile {self.cost.name!r})")
        self.sync(now)
        for r in reqs:
            if r.calls and r.at_call:    # resumed at a call whose result it lacks: the call is made again, now
                self._to_tool(r, keep_kv=False)
            else:
                self.waiting.append(r)
        self.schedule_segment()

    def remove(self, req_ids: list[int], now: float) -> list[SimRequest]:
        """Take requests out wherever they are (running or queued), with their state; unknown ids are skipped
        (already finished). The caller schedules the next segment (`schedule_segment()`) after emitting its events."""
        self.sync(now)
        want, out = set(req_ids), []
        for r in [r for r in self.running if r.req_id in want]:
            self._detach(r)
            out.append(r)
        for r in [r for r in self.waiting if r.req_id in want]:
            self.waiting.remove(r)
            if self._held and r.req_id in self._held:
                self._release_kv(r)
            out.append(r)
        for rid in [rid for rid in req_ids if rid in self.tools]:   # its call goes on; its result is dropped
            r = self.tools.pop(rid)
            if r.req_id in self._held:
                self._release_kv(r)
            out.append(r)
        return out

    def release(self, now: float) -> None:
        """End a hold now (an engine back from the trainer)."""
        self.sync(now)
        self.hold_until = self.t
        self.schedule_segment()

    def hold(self, now: float, duration: float = 0.0, until: float | None = None, version: int | None = None,
             keep_kv: bool = False) -> None:
        """Stop decoding for `duration` from the next step boundary (a weight load, adopting `version` at its end,
        keeping the running sequences' KV if `keep_kv`) or until `until` (colocated training); running requests stay
        resident and resume afterwards."""
        self.sync(now)
        end = max(self.hold_until, self.t) + duration if until is None else max(self.hold_until, until)
        self.hold_until = end
        if version is not None:
            self.pending_version = version
            self.pending_keep_kv = keep_kv
        self._set_busy(False)
        self.schedule_segment()

"""The partial-response pool (Laminar §3.1, §3.2 step 2, §7): the tokens so far of every trajectory on an engine,
streamed by the engines as they grow and held by the controller, on the CPU and away from the engines, so a failed
engine loses at most what it generated since its last report (§3.3: "in-progress trajectory states remain safe").

Engines stream only when a preset's mechanism isolates engine faults (`Preset.isolates_faults`). The request
lifecycle's event fold (sched/fold.py) writes the pool, and nothing else does: an entry opens when a request is
admitted (holding the partial trajectory it resumes from, if any), grows with each `tokens_decoded` event's
`payload["partials"]` chunk (`start`, ids, behaviour log-probs, per-token versions, from that token index on; a
multi-turn request's also its loss mask, so that a resumed episode still never trains on its observations), and
closes when the request leaves its engine (finished, interrupted, aborted). When an engine fails, the fold's
`take_back` (below) returns its requests to PENDING, each resuming from its entry (`take`); `rejoin` lets the engine
take work again once it reports itself rebuilt.

The streaming granularity is not in the paper (Laminar §3.3 gives none); ours is
the engines' counters period (every `counters_every` engine steps, runtime/rollout_worker.py; the simulator's
`counters_every_s`). The simulator's chunks are run-length sequences (rl.types.RunLengthSequence: fake ids, a few
runs each) that carry a request's whole trajectory so far (start 0), cheap to resend at every tick; the pool keeps
them as they are, never as per-token lists.

Invariant kept: an entry only grows, and a chunk must start within what the entry holds (a gap is an
InvariantError: tokens would be missing from the resumed trajectory).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from rl.types import RunLengthSequence, Trajectory
from sched.base import InvariantError
from sched.events import Event
from sched.views import ON_ENGINE, RequestState, Views

S = RequestState


@dataclass
class PartialEntry:
    ids: Sequence[int] = field(default_factory=list)       # lists (the runtime's) or run-length (the simulator's)
    logprobs: Sequence[float] = field(default_factory=list)
    versions: Sequence[int] = field(default_factory=list)
    streamed: int = 0    # tokens that arrived by stream (not carried in from a resume)
    mask: list[int] | None = None   # a multi-turn request's loss mask (None: single-turn)


# (start, ids, log-probs, versions), and a multi-turn request's loss mask over those tokens
Chunk = tuple[int, list[int], list[float], list[int]] | tuple[int, list[int], list[float], list[int], list[int]]


class PartialPool:
    def __init__(self) -> None:
        self.entries: dict[int, PartialEntry] = {}
        self.tokens_streamed = 0

    def __len__(self) -> int:
        return len(self.entries)

    def open(self, req_id: int, partial: Trajectory | None) -> None:
        """A request admitted to an engine: its entry starts from the tokens it resumes from."""
        if partial is None:
            self.entries[req_id] = PartialEntry()
        elif isinstance(partial.response_ids, RunLengthSequence):   # read-only: kept as they are
            self.entries[req_id] = PartialEntry(partial.response_ids, partial.logprobs, partial.versions)
        else:
            mask = list(partial.loss_mask) if partial.loss_mask is not None else None
            self.entries[req_id] = PartialEntry(list(partial.response_ids), list(partial.logprobs),
                                                list(partial.versions), mask=mask)

    def grow(self, req_id: int, chunk: Chunk) -> None:
        """Tokens from index `start` on, as the engine streamed them (a chunk may repeat tokens already held)."""
        entry = self.entries.get(req_id)
        if entry is None:
            return   # left its engine already (the stream and the departure crossed)
        start, ids, lps, versions = chunk[:4]
        mask = chunk[4] if len(chunk) > 4 else None
        if not len(ids) == len(lps) == len(versions) or (mask is not None and len(mask) != len(ids)):
            raise InvariantError(f"partial chunk for request {req_id}: {len(ids)} ids, {len(lps)} log-probs, "
                                 f"{len(versions)} versions")
        if start > len(entry.ids):
            raise InvariantError(f"partial chunk for request {req_id} starts at token {start} but the pool holds "
                                 f"{len(entry.ids)}: tokens would be missing")
        new = start + len(ids) - len(entry.ids)
        if new <= 0:
            return
        if isinstance(ids, RunLengthSequence):   # the simulator's: the whole trajectory so far
            if start != 0:
                raise InvariantError(f"run-length partial chunk for request {req_id} starts at token {start}, not 0")
            entry.ids, entry.logprobs, entry.versions = ids, lps, versions
        else:
            if not isinstance(entry.ids, list):
                entry.ids, entry.logprobs, entry.versions = (list(entry.ids), list(entry.logprobs),
                                                             list(entry.versions))
            del entry.ids[start:], entry.logprobs[start:], entry.versions[start:]
            entry.ids += ids
            entry.logprobs += lps
            entry.versions += versions
            if mask is not None:
                entry.mask = (entry.mask or [1] * start)[:start] + list(mask)
        entry.streamed += new
        self.tokens_streamed += new

    def close(self, req_id: int) -> None:
        self.entries.pop(req_id, None)

    def take(self, req_id: int, like: Trajectory | None, group_id: int, sample_index: int, prompt_ids: list[int],
             prompt_index: int) -> Trajectory | None:
        """Close a failed engine's request's entry; its tokens so far as a partial trajectory to resume from (None:
        nothing generated yet, it starts afresh)."""
        entry = self.entries.pop(req_id, None)
        if entry is None or not entry.ids:
            return like
        return Trajectory(group_id=group_id, sample_index=sample_index, prompt_ids=list(prompt_ids),
                          response_ids=entry.ids, logprobs=entry.logprobs, versions=entry.versions,
                          finish_reason="interrupted", prompt_index=prompt_index, meta={"from_pool": True},
                          loss_mask=entry.mask)


def take_back(v: Views, pool: PartialPool, ev: Event, emit: Callable[[Event], None]) -> None:
    """The event fold's `engine_failed` (Laminar §3.3): the engine's trajectories are safe in the pool. Its requests
    come back PENDING with their tokens so far (a migration's still go to its destination), aborting ones are
    closed as aborted; dispatch resumes them elsewhere. The engine takes nothing until it rejoins."""
    err = ev.data.get("error", "unknown error")
    e = v.engines[ev.engine]
    e.failed, e.retired, e.failures = True, bool(ev.data.get("permanent")), e.failures + 1
    e.loading, e.running, e.waiting, e.kv_used, e.kv_free = False, 0, 0, 0, 0
    if all(x.retired for x in v.engines):
        raise RuntimeError(f"every engine failed for good (the last, engine {ev.engine}: {err})")
    held = {int(rid): n for rid, n in ev.data.get("held", {}).items()}
    resumed = kept = lost = dropped = 0
    for r in v.requests.in_state(*ON_ENGINE):
        if r.engine != ev.engine:
            continue
        e.assigned -= 1
        if r.state == S.ABORTING:   # already counted dropped: its confirmation will never come
            v.requests.set_state(r, S.ABORTED)
            pool.close(r.req_id)
            emit(Event("trajectory_aborted", v.now, engine=r.engine, req_id=r.req_id, group_id=r.group_id,
                       data={"requeue": False, "engine_failed": True}))
            dropped += 1
            continue
        if r.state == S.REQUEUEING:   # sent back to start over anyway: the pool's tokens are not kept
            pool.close(r.req_id)
            part = r.partial
        else:
            part = pool.take(r.req_id, r.partial, r.group_id, r.sample_index,
                             v.groups[r.group_id].prompt.prompt_ids, r.prompt_index)
        n = len(part.response_ids) if part is not None else 0
        resumed, kept, lost = resumed + 1, kept + n, lost + max(held.get(r.req_id, n) - n, 0)
        r.partial, r.tokens = part, n
        if r.migrate_to >= 0 and r.state == S.INTERRUPTING:
            v.migrations.append((r.req_id, r.engine, r.migrate_to))
        v.requests.set_state(r, S.PENDING)
        r.engine, r.migrate_to, r.tool_since = -1, -1, -1.0   # a tool call it waited on is abandoned
    emit(Event("trajectories_recovered", v.now, engine=ev.engine,
               data={"resumed": resumed, "tokens_kept": kept, "tokens_lost": lost, "dropped": dropped}))


def rejoin(v: Views, ev: Event) -> None:
    """The event fold's `engine_recovered`: a failed engine, rebuilt and holding nothing, takes work again."""
    e = v.engines[ev.engine]
    if not e.failed or e.retired or e.assigned:
        why = "retired" if e.retired else "holding requests" if e.assigned else "not failed"
        raise InvariantError(f"engine {ev.engine} rejoined but it was {why}")
    e.failed, e.version = False, ev.version

"""The event fold: how each backend event changes the views, and the group accounting it shares with the aborts.
The request lifecycle (sched/lifecycle.py) holds one `EventFold` as `Lifecycle.fold`; the controller folds every
event in through `apply`, in arrival order, each logged first. The races an event may settle (a request that
finished before its abort landed, an interrupt that lands after a drop, a late reward for a discarded sample) follow
the rules in sched/lifecycle.py's docstring.

Per event: `tokens_decoded` updates an engine's counters and its requests' progress; `trajectory_finished` finishes
a request (or closes a dropped one as discarded); `reward_scored` adds the trajectory to its group unless it was
discarded; `trajectory_interrupted` keeps the tokens so far as the request's `partial` and makes it PENDING again
(queued for its Migrate's destination, if any); `trajectory_aborted` confirms an abort or requeue (or drops a
request its backend stopped on its own); `train_step_done`, `version_published` and `weights_loaded` move the
trainer's and the engines' versions; `engine_failed` takes a failed engine's requests back, resuming each from the
partial-response pool (`tokens_decoded` events stream it when the run isolates engine faults), and
`engine_recovered` lets the engine take work again (both in sched/partials.py: `take_back`, `rejoin`);
`rank_failed` ends the run.

Group accounting (`drop`, `materialize`): a dropped sample is counted in its group at once (its trajectory taken back
out if scored); a group materialises once every kept sample is scored, logged `group_materialized` once.

Restored requests (after a resume, sched/resume.py) stay RESTORED, invisible to dispatch, until every engine holds
the trainer's checkpointed version (`restore_floor`); `weights_loaded` then releases them to PENDING
(`release_restored`).

Invariants kept here: every event is logged before it is applied; a reward for a discarded sample is never added to
its group; a partial only grows and its three per-token lists have one entry per token; a trainer version only moves
on a step that stepped.

Multi-turn requests (rl/env.py): `tool_started` / `tool_finished` mark a request on its engine as waiting on a tool
(`Request.tool_since`, read by policies through `Request.on_tool`) and back; leaving the engine clears it.
"""
from __future__ import annotations

from typing import Callable

from rl.types import Trajectory
from sched.base import InvariantError
from sched.events import Event
from sched.partials import PartialPool, rejoin, take_back
from sched.views import ON_ENGINE, GroupState, Request, RequestState, Views

S = RequestState
LEFT_ENGINE = ("trajectory_finished", "trajectory_interrupted", "trajectory_aborted")


class EventFold:
    def __init__(self, v: Views, emit: Callable[[Event], None]):
        self.v, self.emit = v, emit
        self.interrupted = 0                          # interrupts that landed (a request may be interrupted often)
        self.restore_floor: int | None = None         # after a resume: the version every engine must hold first
        self.partials: PartialPool | None = None      # the partial-response pool, when engine faults are isolated
        self.resets: list[int] = []                   # failed engines whose requests were taken back (to tell them)

    def apply(self, ev: Event) -> None:
        """Fold one backend event into the views (logged first)."""
        v = self.v
        v.now = ev.t
        v.seq += 1
        self.emit(ev)
        k = ev.kind
        if k in LEFT_ENGINE:
            r = v.requests.get(ev.req_id)
            if r is not None and r.tool_since != -1.0:
                v.requests.set_tool(r, -1.0)
            if self.partials is not None:
                self.partials.close(ev.req_id)
        if k == "tokens_decoded":
            e = v.engines[ev.engine]
            d = ev.data
            e.running, e.waiting = d.get("running", e.running), d.get("waiting", e.waiting)
            e.preemptions = d.get("preemptions", e.preemptions)
            e.kv_used, e.kv_free = d.get("kv_used", e.kv_used), d.get("kv_free", e.kv_free)
            e.tokens_decoded = d.get("total", e.tokens_decoded)
            if "progress" in d:
                v.requests.set_tokens(d["progress"])
            if self.partials is not None and ev.payload:
                for rid, chunk in ev.payload.get("partials", {}).items():
                    r = v.requests.get(rid)
                    if r is not None and r.engine == ev.engine and r.state in ON_ENGINE:
                        self.partials.grow(rid, chunk)
        elif k == "tool_started" or k == "tool_finished":
            r = v.requests.get(ev.req_id)
            if r is not None and r.engine == ev.engine and r.state in ON_ENGINE:
                started = k == "tool_started"
                v.requests.set_tool(r, ev.t if started else -1.0)
                r.tool_calls += started
        elif k == "trajectory_finished":
            r = v.requests[ev.req_id]
            r.tokens, r.finished_seq = ev.data.get("tokens", r.tokens), v.seq
            r.preemptions = ev.data.get("preemptions", r.preemptions)
            v.finishes.setdefault(r.round, []).append(r.req_id)
            v.finished += 1
            v.engines[r.engine].assigned -= 1
            self._finished(r)
        elif k == "reward_scored":
            self._scored(ev)
        elif k == "trajectory_interrupted":
            if ev.req_id in v.requests:
                self._interrupted(v.requests[ev.req_id], ev)
        elif k == "trajectory_aborted":
            if ev.req_id in v.requests:  # else its round was already consumed and forgotten
                self._aborted(v.requests[ev.req_id], bool(ev.data.get("requeue")))
        elif k == "train_step_done":
            t = v.trainer
            t.busy = False
            if ev.data.get("stepped", True):
                t.version, t.steps_done, t.groups_since_step = ev.version, t.steps_done + 1, 0
        elif k == "version_published":
            v.trainer.published = max(v.trainer.published, ev.version)
        elif k == "weights_loaded":
            e = v.engines[ev.engine]
            e.version, e.loading = ev.version, False
            self.release_restored()
        elif k == "engine_failed":
            if self.partials is None:
                err = ev.data.get("error", "unknown error")
                raise RuntimeError(f"engine {ev.engine} (rank {ev.rank}) failed: {err}; this run does not isolate "
                                   f"engine faults")
            take_back(v, self.partials, ev, self.emit)
            self.resets.append(ev.engine)
        elif k == "engine_recovered":
            rejoin(v, ev)
        elif k == "rank_failed":
            raise RuntimeError(f"rank {ev.rank} failed: {ev.data.get('error', 'unknown error')}")

    def _finished(self, r: Request) -> None:
        if r.state == S.ABORTING:      # finished before the abort landed: discarded (already counted dropped)
            self.v.requests.set_state(r, S.ABORTED)
            self.emit(Event("trajectory_aborted", self.v.now, engine=r.engine, req_id=r.req_id, group_id=r.group_id,
                            data={"requeue": False, "discarded": True}))
        else:                          # a REQUEUEING or INTERRUPTING one that finished first simply finished
            self.v.requests.set_state(r, S.FINISHED)

    def _scored(self, ev: Event) -> None:
        v = self.v
        traj: Trajectory = ev.payload
        g = v.groups.get(ev.group_id)
        if g is None:  # its round was consumed and forgotten: a discarded sample's late reward
            return
        if traj is None or traj.group_id != g.group_id:
            raise InvariantError(f"reward_scored event without its trajectory for group {ev.group_id}")
        r = v.requests.get(ev.req_id) if ev.req_id >= 0 else v.requests.get(g.req_ids[traj.sample_index])
        if r is None or r.state != S.ABORTED:  # a discarded trajectory is never trained
            g.trajectories.append(traj)
            g.scored += 1
            v.groups.track(g)
            self.materialize(g)

    def _aborted(self, r: Request, requeue: bool) -> None:
        if r.state not in (S.RUNNING, S.ABORTING, S.REQUEUEING):
            raise InvariantError(f"trajectory_aborted for request {r.req_id} in state {r.state}")
        self.v.engines[r.engine].assigned -= 1
        if r.state == S.ABORTING:
            self.v.requests.set_state(r, S.ABORTED)
        elif r.state == S.REQUEUEING or requeue:
            self.v.requests.set_state(r, S.PENDING)
            r.engine = -1
        else:                          # stopped by the backend on its own
            self.drop(r)

    def _interrupted(self, r: Request, ev: Event) -> None:
        v = self.v
        part = ev.payload
        if r.state not in (S.INTERRUPTING, S.ABORTING, S.REQUEUEING):
            raise InvariantError(f"trajectory_interrupted for request {r.req_id} in state {r.state}")
        if part is None or len(part.response_ids) < r.resumed_tokens or \
                len(part.logprobs) != len(part.response_ids) or len(part.versions) != len(part.response_ids):
            raise InvariantError(f"trajectory_interrupted for request {r.req_id} without a consistent partial "
                                 f"trajectory (it had {r.resumed_tokens} tokens before)")
        v.engines[r.engine].assigned -= 1
        self.interrupted += 1
        src = r.engine
        if "kv_rank" in part.meta:     # its KV stays on this engine's rank until a SendKV (or a drop) takes it
            part.meta["kv_engine"] = src
        r.partial, r.tokens = part, len(part.response_ids)
        if r.state == S.ABORTING:      # dropped while its interrupt was in flight: discarded
            v.requests.set_state(r, S.ABORTED)
            self.emit(Event("trajectory_aborted", v.now, engine=src, req_id=r.req_id, group_id=r.group_id,
                            data={"requeue": False, "interrupted": True}))
            return
        v.requests.set_state(r, S.PENDING)
        r.engine = -1
        if r.migrate_to >= 0:
            v.migrations.append((r.req_id, src, r.migrate_to))
        r.migrate_to = -1

    def drop(self, r: Request) -> None:
        """Count request r dropped in its group (taking its trajectory back out if it was already scored)."""
        v = self.v
        g = v.groups[r.group_id]
        if g.consumed:
            raise InvariantError(f"request {r.req_id} dropped after its group {g.group_id} was trained")
        kept = [t for t in g.trajectories if t.sample_index != r.sample_index]
        g.scored -= len(g.trajectories) - len(kept)
        g.trajectories = kept
        g.dropped += 1
        v.groups.track(g)
        v.dropped += 1
        if r.state == S.RUNNING:
            v.requests.set_state(r, S.ABORTED)
        self.materialize(g)

    def materialize(self, g: GroupState) -> None:
        if g.materialized and g.materialized_seq < 0:
            g.materialized_seq = self.v.seq
            self.v.materialized += 1
            self.emit(Event("group_materialized", self.v.now, group_id=g.group_id, version=g.version,
                            data={"round": g.round}))

    def release_restored(self) -> int:
        """Once every engine holds at least the checkpointed trainer version (and is not loading), make the
        restored requests pending again; how many were released."""
        floor = self.restore_floor
        if floor is None:
            return 0
        engines = self.v.engines
        if not engines or any(e.version < floor or e.loading for e in engines):
            return 0
        out = [r for r in self.v.requests.values() if r.state == S.RESTORED]
        for r in out:
            self.v.requests.set_state(r, S.PENDING)
        self.restore_floor = None
        return len(out)

"""How the controller folds a backend's event into the views (mixed into the Controller, like sched/aborts.py and
sched/partials.py): engine counters, finished / interrupted / aborted trajectories, scored rewards (a group is
materialised once all its kept samples are scored), trainer steps, publications and weight loads.

Invariants kept here: every event is logged before it is applied, in arrival order; a reward for a discarded
sample is never added to its group; a trainer version only moves on a step that stepped.
"""
from __future__ import annotations

from rl.types import Trajectory
from sched.aborts import InvariantError
from sched.base import GroupState, Request, Views
from sched.events import Event
from sched.snapshot import release_held


class EventFold:
    """Mixed into the Controller, last in its bases (the stubs below stand for the other mixins' methods)."""
    v: Views

    def emit(self, ev: Event) -> None: ...
    def on_finished(self, r: Request) -> None: ...
    def on_interrupted(self, r: Request, ev: Event) -> None: ...
    def on_aborted(self, r: Request, requeue: bool) -> None: ...
    def _materialize(self, g: GroupState) -> None: ...

    def apply(self, ev: Event) -> None:
        v = self.v
        v.now = ev.t
        v.seq += 1
        self.emit(ev)
        k = ev.kind
        if k == "tokens_decoded":
            e = v.engines[ev.engine]
            d = ev.data
            e.running, e.waiting = d.get("running", e.running), d.get("waiting", e.waiting)
            e.kv_used, e.kv_free = d.get("kv_used", e.kv_used), d.get("kv_free", e.kv_free)
            e.tokens_decoded = d.get("total", e.tokens_decoded)
            for rid, n in d.get("progress", {}).items():
                if int(rid) in v.requests:
                    v.requests[int(rid)].tokens = n
        elif k == "trajectory_finished":
            r = v.requests[ev.req_id]
            r.tokens, r.finished_seq = ev.data.get("tokens", r.tokens), v.seq
            v.engines[r.engine].assigned -= 1
            self.on_finished(r)
        elif k == "reward_scored":
            traj: Trajectory = ev.payload
            g = v.groups.get(ev.group_id)
            if g is None:  # its round was consumed and forgotten: a discarded sample's late reward
                return
            if traj is None or traj.group_id != g.group_id:
                raise InvariantError(f"reward_scored event without its trajectory for group {ev.group_id}")
            r = v.requests.get(ev.req_id) if ev.req_id >= 0 else v.requests.get(g.req_ids[traj.sample_index])
            if r is None or r.state != "aborted":  # a discarded trajectory is never trained
                g.trajectories.append(traj)
                g.scored += 1
                self._materialize(g)
        elif k == "trajectory_interrupted":
            if ev.req_id in v.requests:
                self.on_interrupted(v.requests[ev.req_id], ev)
        elif k == "trajectory_aborted":
            if ev.req_id in v.requests:  # else its round was already consumed and forgotten
                self.on_aborted(v.requests[ev.req_id], bool(ev.data.get("requeue")))
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
            release_held(self)  # requests restored from a checkpoint wait for weights
        elif k == "rank_failed":
            raise RuntimeError(f"rank {ev.rank} failed: {ev.data.get('error', 'unknown error')}")

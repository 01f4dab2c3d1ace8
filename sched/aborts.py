"""How the controller settles aborts (sched.base.Abort), so every policy and both backends see the same rules.

- requeue=False drops a request for good, counted in its group's `dropped` the moment the abort is decided, so
  the group can materialise (or become void) at once:
    running  -> "aborting", sent to its engine; the engine's `trajectory_aborted` closes it ("aborted"), or, if
                it finished before the abort landed, its `trajectory_finished` does and the trajectory is
                discarded (its later reward is ignored);
    pending  -> "aborted" here, never sent;
    finished -> "aborted" here: the trajectory is discarded (taken back out of its group if already scored);
                dropping one of a group already handed to the trainer is an InvariantError.
- requeue=True sends a running request back to pending ("requeueing" until the engine confirms); one that
  finishes first simply stays finished. Requeueing a pending or finished request does nothing.
- An "interrupting" request (Interrupt sent, not yet handed back) dropped with requeue=False becomes "aborting"
  and its `trajectory_interrupted` (or `trajectory_finished`) closes it as discarded; requeue=True on it does
  nothing (it comes back pending anyway).
- Aborting an aborting/aborted request again does nothing, so a policy may repeat itself.
Every dropped request gets exactly one `trajectory_aborted` event in the log: the engine's, or the controller's
own (data `local`: never sent; `discarded`: it had finished). Backends report `trajectory_aborted` only for
requests they actually stopped.
"""
from __future__ import annotations

from typing import Any

from sched.base import Abort, GroupState, Request, Views
from sched.events import Event


class InvariantError(RuntimeError):
    """A policy made a decision that breaks a rule every preset must keep."""


class AbortRules:
    """Mixed into the Controller: the abort decision and the events that settle it."""
    v: Views
    dropped: int

    def emit(self, ev: Event) -> None: ...

    def abort(self, backend: Any, cmd: Abort) -> None:
        v = self.v
        send: dict[int, list[int]] = {}
        for rid in cmd.req_ids:
            r = v.requests[rid]
            if r.state == "running":
                r.state = "requeueing" if cmd.requeue else "aborting"
                send.setdefault(r.engine, []).append(rid)
                if not cmd.requeue:
                    self._drop(r)
            elif r.state in ("pending", "finished") and not cmd.requeue:
                how = "local" if r.state == "pending" else "discarded"
                self._drop(r)
                r.state = "aborted"
                self.emit(Event("trajectory_aborted", v.now, engine=r.engine, req_id=rid, group_id=r.group_id,
                                data={"requeue": False, how: True}))
            elif r.state == "interrupting" and not cmd.requeue:
                r.state = "aborting"   # its trajectory_interrupted will close it (the engine no longer holds it)
                self._drop(r)
        for engine, ids in sorted(send.items()):
            backend.command(Abort(engine, ids, cmd.requeue))

    def on_finished(self, r: Request) -> None:
        if r.state == "aborting":      # finished before the abort landed: discarded (already counted dropped)
            r.state = "aborted"
            self.emit(Event("trajectory_aborted", self.v.now, engine=r.engine, req_id=r.req_id, group_id=r.group_id,
                            data={"requeue": False, "discarded": True}))
        else:                          # a "requeueing" one that finished first simply stays finished
            r.state = "finished"

    def on_aborted(self, r: Request, requeue: bool) -> None:
        if r.state not in ("running", "aborting", "requeueing"):
            raise InvariantError(f"trajectory_aborted for request {r.req_id} in state {r.state}")
        self.v.engines[r.engine].assigned -= 1
        if r.state == "aborting":
            r.state = "aborted"
        elif r.state == "requeueing" or requeue:
            r.state, r.engine = "pending", -1
        else:                          # stopped by the backend on its own
            self._drop(r)

    def _drop(self, r: Request) -> None:
        """Count request r dropped in its group (taking its trajectory back out if it was already scored)."""
        g = self.v.groups[r.group_id]
        if g.consumed:
            raise InvariantError(f"request {r.req_id} dropped after its group {g.group_id} was trained")
        kept = [t for t in g.trajectories if t.sample_index != r.sample_index]
        g.scored -= len(g.trajectories) - len(kept)
        g.trajectories = kept
        g.dropped += 1
        self.dropped += 1
        self.v.dropped += 1
        if r.state == "running":
            r.state = "aborted"
        self._materialize(g)

    def _materialize(self, g: GroupState) -> None:
        if g.materialized and g.materialized_seq < 0:
            g.materialized_seq = self.v.seq
            self.v.materialized += 1
            self.emit(Event("group_materialized", self.v.now, group_id=g.group_id, version=g.version,
                            data={"round": g.round}))

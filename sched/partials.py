"""How the controller moves partial trajectories (sched.base.Interrupt and Migrate), so every policy and both
backends see the same rules (mixed into the Controller, like sched/aborts.py):

- Interrupt: a running request becomes "interrupting" and its engine is asked to hand it back; requests in any other
  state are skipped (one that finished first simply finished). The engine's `trajectory_interrupted` carries every
  token so far (ids, behaviour log-probs, per-token versions; the seeded generator state on real engines); the
  request keeps it as `partial` and waits "pending" again, to resume on whichever engine dispatch picks (the engine
  re-prefills prompt + tokens so far). Its `v_traj` never changes.
- Migrate(src, dst): an Interrupt whose request is resubmitted to dst as soon as it lands, before any other
  admission (`trajectory_migrated`, data src/dst/tokens).
- Dropped (Abort, requeue=False) while its interrupt is in flight: the interrupt's event closes it as discarded.
Invariants kept here: a partial only grows; its three per-token lists have one entry per token.
"""
from __future__ import annotations

from typing import Any

from sched.aborts import InvariantError
from sched.base import Interrupt, Migrate, Request, Submit, Views
from sched.events import Event


class PartialRules:
    """Mixed into the Controller: the Interrupt/Migrate decisions and the event that settles them."""
    v: Views
    interrupted: int                               # interrupts that landed
    migrations: list[tuple[int, int, int]]         # (req_id, src, dst) interrupted, awaiting resubmission

    def emit(self, ev: Event) -> None: ...
    def submit(self, backend: Any, sub: Submit) -> None: ...

    def interrupt(self, backend: Any, req_ids: list[int], migrate_to: int = -1) -> None:
        """Ask engines to hand back running requests (others are skipped: a finished one simply finished)."""
        v = self.v
        send: dict[int, list[int]] = {}
        for rid in req_ids:
            r = v.requests.get(rid)
            if r is None or r.state != "running" or r.engine == migrate_to:
                continue
            r.state, r.migrate_to = "interrupting", migrate_to
            send.setdefault(r.engine, []).append(rid)
        for engine, ids in sorted(send.items()):
            backend.command(Interrupt(engine, ids))

    def migrate(self, backend: Any, cmd: Migrate) -> None:
        if not 0 <= cmd.dst < len(self.v.engines):
            raise InvariantError(f"migration to unknown engine {cmd.dst}")
        self.interrupt(backend, cmd.req_ids, migrate_to=cmd.dst)

    def on_interrupted(self, r: Request, ev: Event) -> None:
        v = self.v
        part = ev.payload
        if r.state not in ("interrupting", "aborting", "requeueing"):
            raise InvariantError(f"trajectory_interrupted for request {r.req_id} in state {r.state}")
        if part is None or len(part.response_ids) < r.resumed_tokens or \
                len(part.logprobs) != len(part.response_ids) or len(part.versions) != len(part.response_ids):
            raise InvariantError(f"trajectory_interrupted for request {r.req_id} without a consistent partial "
                                 f"trajectory (it had {r.resumed_tokens} tokens before)")
        v.engines[r.engine].assigned -= 1
        self.interrupted += 1
        src = r.engine
        r.partial, r.tokens = part, len(part.response_ids)
        if r.state == "aborting":      # dropped while its interrupt was in flight: discarded
            r.state = "aborted"
            self.emit(Event("trajectory_aborted", v.now, engine=src, req_id=r.req_id, group_id=r.group_id,
                            data={"requeue": False, "interrupted": True}))
            return
        r.state, r.engine = "pending", -1
        if r.migrate_to >= 0:
            self.migrations.append((r.req_id, src, r.migrate_to))
        r.migrate_to = -1

    def resubmit_migrated(self, backend: Any) -> None:
        todo, self.migrations = self.migrations, []
        for rid, src, dst in todo:
            r = self.v.requests.get(rid)
            if r is None or r.state != "pending":
                continue
            self.submit(backend, Submit(dst, [rid]))
            self.emit(Event("trajectory_migrated", self.v.now, engine=dst, req_id=rid, group_id=r.group_id,
                            version=self.v.engines[dst].version, data={"src": src, "dst": dst, "tokens": r.tokens}))

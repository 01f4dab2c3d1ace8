"""The request lifecycle: every state transition of requests, groups, engines and the trainer in the views, and the
rules that settle races. The controller (sched/controller.py) owns one `Lifecycle`, calls it for each decision it
performs and each event it receives, and sends the backend commands it returns. Nothing else writes the views.

It is three objects: this one owns the decisions on requests and groups (rounds, admissions, aborts, interrupts and
migrations, hand-off to the trainer, forgetting closed rounds) and the counters they need (`next_req`,
`next_group`, `trained`); it holds the other two as attributes:
    fold   an `EventFold` (sched/fold.py): every backend event into the views (`fold.apply`, in arrival order, each
           logged first), the group accounting (`drop`, `materialize`) and the release of restored requests
    pool   an `EnginePool` (sched/engine_pool.py): the elastic pool's decisions (LendEngines / ReturnEngines /
           AddEngines / Reshard)

Rounds: `start_round` makes a round's groups and their requests (PENDING); `admit` sends pending requests to an
engine (RUNNING; `request_admitted`).

Aborts (`abort`, for `sched.decisions.Abort`), so every policy and both backends see the same rules:
- requeue=False drops a request for good, counted in its group's `dropped` the moment the abort is decided, so
  the group can materialise (or become void) at once:
    RUNNING  -> ABORTING, sent to its engine; the engine's `trajectory_aborted` closes it (ABORTED), or, if it
                finished before the abort landed, its `trajectory_finished` does and the trajectory is discarded
                (its later reward is ignored);
    PENDING  -> ABORTED here, never sent (a migrated one whose KV an engine keeps: that engine is told, and
                drops the KV without a further event);
    FINISHED -> ABORTED here: the trajectory is discarded (taken back out of its group if already scored);
                dropping one of a group already handed to the trainer is an InvariantError.
- requeue=True sends a running request back to pending (REQUEUEING until the engine confirms); one that finishes
  first simply stays finished. Requeueing a pending or finished request does nothing.
- An INTERRUPTING request dropped with requeue=False becomes ABORTING and its `trajectory_interrupted` (or
  `trajectory_finished`) closes it as discarded; requeue=True on it does nothing (it comes back pending anyway).
- Aborting an aborting/aborted request again does nothing, so a policy may repeat itself.
Every dropped request gets exactly one `trajectory_aborted` event in the log: the engine's, or the lifecycle's own
(data `local`: never sent; `discarded`: it had finished). Backends report `trajectory_aborted` only for requests
they actually stopped.

Partial trajectories (`interrupt`, `migrate`, for `sched.decisions.Interrupt` and `Migrate`):
- Interrupt: a RUNNING request becomes INTERRUPTING and its engine is asked to hand it back; requests in any other
  state are skipped (one that finished first simply finished). The engine's `trajectory_interrupted` carries
  every token so far (ids, behaviour log-probs, per-token versions; the seeded generator state on real engines);
  the request keeps it as `partial` and waits PENDING again, to resume on whichever engine dispatch picks (the
  engine re-prefills prompt + tokens so far). Its `v_traj` never changes.
- Migrate(src, dst): an Interrupt whose request is resubmitted to dst as soon as it lands, before any other
  admission (`due_migrations`; `trajectory_migrated`, data src/dst/tokens).

Failed engines (Laminar §3.3, when the run isolates engine faults): the fold takes a failed engine's requests back
PENDING, each with its tokens so far from the partial-response pool (sched/partials.py), which `admit` opens for
every request it sends; nothing is submitted to a failed engine, loaded into it or migrated onto it until its
`engine_recovered`. The controller tells the engine its requests were taken back (`ResetEngine`): whatever was
sent to it before that is void there.

Restored requests (after a resume, sched/resume.py) stay RESTORED, invisible to dispatch, until every engine holds
the trainer's checkpointed version; `weights_loaded` then releases them to PENDING (`fold.release_restored`).

Invariants kept here: a group is handed to the trainer whole, once, only after it materialised, and no trajectory
staler than the preset's bound; a resumed trajectory never goes back in version; engines load only published
versions; no request is placed on a lent or failed engine or one without weights. The fold keeps the events' own
(sched/fold.py).
"""
from __future__ import annotations

from typing import Any, Callable

from rl.types import Group
from sched.base import InvariantError
from sched.decisions import Abort, Interrupt, LoadWeights, Migrate, RoundPlan, Submit
from sched.engine_pool import EnginePool
from sched.events import Event
from sched.fold import EventFold
from sched.views import GroupState, Request, RequestState, Views

S = RequestState


class Lifecycle:
    def __init__(self, v: Views, emit: Callable[[Event], None]):
        self.v, self.emit = v, emit
        self.next_req = 0
        self.next_group = 0
        self.trained: set[tuple[int, int]] = set()   # (group_id, sample_index) handed to the trainer
        self.fold = EventFold(v, emit)                # backend events into the views; group accounting
        self.pool = EnginePool(v, emit)               # the elastic pool's decisions

    # ----------------------------------------------------------------------------------------------- rounds
    def start_round(self, plan: RoundPlan, items: list[Any]) -> None:
        """A new round: one group of G requests per prompt item (PENDING), `round_started`."""
        v = self.v
        v.round += 1
        v.round_groups[v.round] = []
        v.plans[v.round] = plan
        G = plan.group_size or v.group_size
        for item in items:
            gid = self.next_group
            self.next_group += 1
            g = GroupState(gid, item.prompt_index, v.round, G, answer=item.answer, prompt=item)
            v.groups[gid] = g
            v.round_groups[v.round].append(gid)
            for s in range(G):
                v.requests[self.next_req] = Request(self.next_req, gid, s, item.prompt_index, v.round,
                                                    len(item.prompt_ids), t_created=v.now)
                g.req_ids.append(self.next_req)
                self.next_req += 1
        data = {"round": v.round, "prompts": len(items), "group_size": G, "kind": plan.kind}
        if plan.speculative:
            data.update(keep_groups=plan.keep_groups, keep_per_group=plan.keep_per_group)
        self.emit(Event("round_started", v.now, data=data))

    def admit(self, sub: Submit) -> list[Request]:
        """PENDING -> RUNNING on `sub.engine`, one `request_admitted` each; the requests to send."""
        v = self.v
        e = v.engines[sub.engine]
        pool = self.fold.partials
        reqs = [v.requests[i] for i in sub.req_ids]
        for r in reqs:
            if (why := self.refuses(sub.engine, r)) is not None:
                raise InvariantError(f"request {r.req_id} submitted to engine {sub.engine}, {why}")
            if r.state != S.PENDING:
                raise InvariantError(f"request {r.req_id} submitted twice (state {r.state})")
            if r.v_traj < 0:
                r.v_traj = e.version
            r.engine, r.version = sub.engine, e.version   # the engine first: the table indexes it by engine
            v.requests.set_state(r, S.RUNNING)
            if pool is not None:
                pool.open(r.req_id, r.partial)
            self.emit(Event("request_admitted", v.now, engine=sub.engine, req_id=r.req_id, group_id=r.group_id,
                            version=e.version))
        e.assigned += len(reqs)
        return reqs

    def load_weights(self, cmd: LoadWeights) -> None:
        if cmd.version > self.v.trainer.published:
            raise InvariantError(f"engine {cmd.engine} told to load unpublished version {cmd.version}")
        if self.v.engines[cmd.engine].failed:
            raise InvariantError(f"engine {cmd.engine} told to load weights while it is failed")
        self.v.engines[cmd.engine].loading = True

    # ----------------------------------------------------------------------------------------------- aborts
    def abort(self, cmd: Abort) -> list[Abort]:
        """Apply an Abort decision (module docstring); the aborts to send, one per engine."""
        v = self.v
        send: dict[int, list[int]] = {}
        for rid in cmd.req_ids:
            r = v.requests[rid]
            if r.state == S.RUNNING:
                v.requests.set_state(r, S.REQUEUEING if cmd.requeue else S.ABORTING)
                send.setdefault(r.engine, []).append(rid)
                if not cmd.requeue:
                    self.fold.drop(r)
            elif r.state in (S.PENDING, S.FINISHED) and not cmd.requeue:
                how = "local" if r.state == S.PENDING else "discarded"
                keeper = r.partial.meta.get("kv_engine", -1) if r.partial is not None else -1
                if r.state == S.PENDING and keeper >= 0:   # its migrated KV is kept there: let it go
                    send.setdefault(keeper, []).append(rid)
                self.fold.drop(r)
                v.requests.set_state(r, S.ABORTED)
                self.emit(Event("trajectory_aborted", v.now, engine=r.engine, req_id=rid, group_id=r.group_id,
                                data={"requeue": False, how: True}))
            elif r.state == S.INTERRUPTING and not cmd.requeue:
                v.requests.set_state(r, S.ABORTING)  # its trajectory_interrupted closes it (the engine lets it go)
                self.fold.drop(r)
        return [Abort(engine, ids, cmd.requeue) for engine, ids in sorted(send.items())]

    # --------------------------------------------------------------------------------- partial trajectories
    def interrupt(self, req_ids: list[int], migrate_to: int = -1) -> list[Interrupt]:
        """Ask engines to hand back running requests (others are skipped: a finished one simply finished)."""
        v = self.v
        send: dict[int, list[int]] = {}
        for rid in req_ids:
            r = v.requests.get(rid)
            if r is None or r.state != S.RUNNING or r.engine == migrate_to:
                continue
            v.requests.set_state(r, S.INTERRUPTING)
            r.migrate_to = migrate_to
            send.setdefault(r.engine, []).append(rid)
        return [Interrupt(engine, ids, migrate_to) for engine, ids in sorted(send.items())]

    def migrate(self, cmd: Migrate) -> list[Interrupt]:
        if not 0 <= cmd.dst < len(self.v.engines) or self.v.engines[cmd.dst].lent or self.v.engines[cmd.dst].failed:
            raise InvariantError(f"migration to engine {cmd.dst}: unknown, lent to the trainer, or failed")
        return self.interrupt(cmd.req_ids, migrate_to=cmd.dst)

    def due_migrations(self) -> list[tuple[Submit, int]]:
        """Migrated requests whose interrupt landed: (resubmission to the destination, source engine) each. One
        whose destination can no longer take it (it failed or was lent meanwhile, or holds an older version than the
        trajectory's tokens: in colocated mode the source may have loaded newer weights before the interrupt landed)
        stays PENDING, to be resumed by dispatch like a failed engine's."""
        todo, self.v.migrations = self.v.migrations, []
        out = []
        for rid, src, dst in todo:
            r = self.v.requests.get(rid)
            if r is not None and r.state == S.PENDING and self.refuses(dst, r) is None:
                out.append((Submit(dst, [rid]), src))
        return out

    def refuses(self, engine: int, r: Request) -> str | None:
        """Why `engine` cannot take request r now (None: it can): what `admit` refuses."""
        e = self.v.engines[engine]
        if e.lent or e.version < 0 or e.failed:
            return "lent to the trainer" if e.lent else "which has no weights" if e.version < 0 else "which failed"
        if r.partial is not None and r.partial.versions and e.version < r.partial.newest_version:
            return f"at version {e.version}, older than its tokens so far (version {r.partial.newest_version})"
        return None

    def migrated(self, sub: Submit, src: int) -> None:
        v = self.v
        r = v.requests[sub.req_ids[0]]
        self.emit(Event("trajectory_migrated", v.now, engine=sub.engine, req_id=r.req_id, group_id=r.group_id,
                        version=v.engines[sub.engine].version,
                        data={"src": src, "dst": sub.engine, "tokens": r.tokens}))

    # ---------------------------------------------------------------------------------------------- training
    def consume(self, gids: list[int], max_staleness: int | None) -> list[Group]:
        """Hand these groups to the trainer: each whole, once, materialised, within the staleness bound."""
        v = self.v
        groups = []
        for gid in gids:
            g = v.groups[gid]
            if g.consumed or not g.materialized:
                raise InvariantError(f"group {gid} handed to the trainer "
                                     f"{'twice' if g.consumed else 'before it was materialised'}")
            for t in g.trajectories:
                if max_staleness is not None and v.trainer.version - t.version > max_staleness:
                    raise InvariantError(f"group {gid} sample {t.sample_index} (version {t.version}) handed to the "
                                         f"trainer at version {v.trainer.version}: staleness above the bound "
                                         f"{max_staleness}")
                key = (gid, t.sample_index)
                if key in self.trained:
                    raise InvariantError(f"trajectory {key} trained twice")
                self.trained.add(key)
            g.consumed = True
            v.groups.track(g)
            groups.append(Group(gid, g.prompt_index, g.answer, sorted(g.trajectories, key=lambda t: t.sample_index)))
        v.trainer.busy = True
        v.trainer.groups_consumed += len(gids)
        v.trainer.samples_consumed += sum(len(g.trajectories) for g in groups)
        v.trainer.groups_since_step += len(gids)
        return groups

    def prune(self) -> None:
        """Forget rounds that are fully consumed (older than the current one), so long runs stay bounded."""
        v = self.v
        gone = set()
        for r in [r for r in v.round_groups if r < v.round]:
            if all(v.groups[g].closed for g in v.round_groups[r]):
                v.plans.pop(r, None)
                v.finishes.pop(r, None)
                for g in v.round_groups.pop(r):
                    del v.groups[g]
                gone.add(r)
        if gone:    # one pass over the requests for every round forgotten
            for rid in [i for i, q in v.requests.items() if q.round in gone]:
                del v.requests[rid]

"""The controller: owns the policy objects and is their only caller. Driven by a Backend — the runtime
(torch.distributed ranks) or the simulator (virtual clock) — through the same five calls.

Loop: take the next event, fold it into the views, log it, then ask each mechanism for decisions and hand them to
the backend. The controller also checks the invariants every preset must keep (a group is trained whole, once,
only after it is materialised; nothing finished is lost; no trajectory staler than the preset's bound; a resumed
trajectory never goes back in version), so a buggy policy fails loudly in tests. Abort decisions and the events
that settle them follow the rules of sched/aborts.py, Interrupt / Migrate of partial trajectories those of
sched/partials.py, and events are folded into the views by sched/fold.py (all three mixed in here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from rl.types import Group
from sched.aborts import AbortRules, InvariantError
from sched.fold import EventFold
from sched.partials import PartialRules
from sched.base import (Abort, GroupState, Interrupt, LoadWeights, Migrate, Preset, Request, RoundPlan, Submit,
                        TrainCall, Views, EngineView)
from sched.events import Event, EventLog
from sched.snapshot import load_views, save_views


@dataclass
class PromptItem:
    prompt_index: int
    prompt_ids: list[int]
    answer: str | None
    max_new_tokens: int | None = None  # the prompt's own response cap (e.g. the long-tail task's answer length)


class Backend(Protocol):
    num_engines: int

    def now(self) -> float: ...
    def submit(self, engine: int, reqs: list[Request], prompts: dict[int, PromptItem]) -> None: ...
    def command(self, cmd: Abort | Interrupt | Migrate | LoadWeights) -> None: ...
    def train(self, call: TrainCall, groups: list[Group]) -> None: ...
    def next_event(self) -> Event: ...  # blocks until one is available (the backend enforces its own deadline)
    # optional: `has_pending() -> bool`, whether next_event would return at once with an event that arrived
    # together with the last one (the runtime's engines send one message per step); the controller applies such
    # a batch before deciding once. Backends without it (the simulator) are decided on after every event.


__all__ = ["Backend", "Controller", "InvariantError", "PromptItem"]


class Controller(AbortRules, PartialRules, EventFold):  # EventFold last: its stubs must not shadow the rules
    def __init__(self, preset: Preset, source: Callable[[int], list[PromptItem]], group_size: int,
                 prompts_per_step: int, total_steps: int, log: EventLog | None = None, **params: Any):
        self.preset = preset
        self.source = source
        self.total_steps = total_steps
        self.log = log or EventLog()
        self.v = Views(params=dict(group_size=group_size, prompts_per_step=prompts_per_step, **params))
        self.prompts: dict[int, PromptItem] = {}   # group_id -> its prompt
        self.next_req = 0
        self.next_group = 0
        self.trained: set[tuple[int, int]] = set()  # (group_id, sample_index) handed to the trainer
        self.dropped = 0
        self.interrupted = 0                         # interrupts that landed (a request may be interrupted often)
        self.migrations: list[tuple[int, int, int]] = []  # (req_id, src, dst) interrupted, awaiting resubmission
        bounds = [b for p in preset.policies().values() if (b := p.staleness_bound()) is not None]
        self.max_staleness: int | None = min(bounds) if bounds else None

    # ---------------------------------------------------------------------------------------------- main loop
    @property
    def done(self) -> bool:
        return self.v.trainer.steps_done >= self.total_steps and not self.v.trainer.busy

    def run(self, backend: Backend, after_event: Callable[[Event], None] | None = None) -> Views:
        """Drive the policies until `total_steps` optimizer steps are done. `after_event` runs after each event is
        applied and decided on (the runtime checkpoints there at step boundaries)."""
        if not self.v.engines:
            self.v.engines = [EngineView(engine=i) for i in range(backend.num_engines)]
        self.decide(backend)
        has_pending = getattr(backend, "has_pending", None)
        while not self.done:
            batch = [backend.next_event()]
            while has_pending is not None and has_pending():
                batch.append(backend.next_event())
            for ev in batch:
                self.apply(ev)
            self.decide(backend)
            if after_event is not None:
                for ev in batch:
                    after_event(ev)
        self.log.flush()
        return self.v

    def quiescent(self) -> bool:
        """Nothing generated-but-unconsumed and nothing in flight: a checkpoint needs no trajectory state."""
        return self.v.in_flight() == 0 and not self.v.open_groups() and not self.v.trainer.busy

    def state_dict(self) -> dict[str, Any]:
        t = self.v.trainer
        return {"next_req": self.next_req, "next_group": self.next_group, "round": self.v.round,
                "trainer": {"version": t.version, "steps_done": t.steps_done, "groups_consumed": t.groups_consumed},
                "dropped": self.dropped, "views": save_views(self),
                "policies": {k: p.state_dict() for k, p in self.preset.policies().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_req, self.next_group, self.v.round = state["next_req"], state["next_group"], state["round"]
        t = self.v.trainer
        t.version, t.steps_done = state["trainer"]["version"], state["trainer"]["steps_done"]
        t.groups_consumed = state["trainer"]["groups_consumed"]
        self.dropped = state["dropped"]
        if "views" in state:  # mid-round trajectories and requests (sched/snapshot.py)
            load_views(self, state["views"])
        for k, p in self.preset.policies().items():
            p.load_state_dict(state["policies"].get(k, {}))

    def emit(self, ev: Event) -> None:
        self.log.write(ev)

    # ---------------------------------------------------------------------------------------------- decisions
    def decide(self, backend: Backend) -> None:
        p, v = self.preset, self.v
        plan = 0 if self.v.trainer.steps_done >= self.total_steps else p.dispatch.intake(v)
        if isinstance(plan, RoundPlan) or plan > 0:
            self.start_round(plan)
        self.resubmit_migrated(backend)
        for sub in p.dispatch.admit(v):
            self.submit(backend, sub)
        for cmd in p.rebalance.plan(v):
            self.command(backend, cmd)
        if not v.trainer.busy and v.trainer.steps_done < self.total_steps:
            gids = p.handoff.ready(v)
            if gids:
                self.train(backend, p.update.decide(gids, v), gids)
        for cmd in p.weight_sync.engines_to_load(v):
            self.command(backend, cmd)

    def command(self, backend: Backend, cmd: Abort | Interrupt | Migrate | LoadWeights) -> None:
        v = self.v
        if isinstance(cmd, Abort):
            self.abort(backend, cmd)
        elif isinstance(cmd, Interrupt):
            self.interrupt(backend, cmd.req_ids)
        elif isinstance(cmd, Migrate):
            self.migrate(backend, cmd)
        elif isinstance(cmd, LoadWeights):
            if cmd.version > v.trainer.published:
                raise InvariantError(f"engine {cmd.engine} told to load unpublished version {cmd.version}")
            v.engines[cmd.engine].loading = True
            backend.command(cmd)
        else:
            raise TypeError(f"unknown decision {cmd!r}")

    def start_round(self, plan: int | RoundPlan) -> None:
        v = self.v
        plan = plan if isinstance(plan, RoundPlan) else RoundPlan(fresh=int(plan))
        items = [PromptItem(**p) if isinstance(p, dict) else p for p in plan.prompts]
        items += self.source(plan.fresh) if plan.fresh > 0 else []
        v.round += 1
        v.round_groups[v.round] = []
        v.plans[v.round] = plan
        G = int(plan.group_size or v.params["group_size"])
        for item in items:
            gid = self.next_group
            self.next_group += 1
            self.prompts[gid] = item
            g = v.groups[gid] = GroupState(gid, item.prompt_index, v.round, G, answer=item.answer, prompt=item)
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

    def submit(self, backend: Backend, sub: Submit) -> None:
        v = self.v
        e = v.engines[sub.engine]
        reqs = [v.requests[i] for i in sub.req_ids]
        for r in reqs:
            if r.state != "pending":
                raise InvariantError(f"request {r.req_id} submitted twice (state {r.state})")
            if r.partial is not None and r.partial.versions and e.version < max(r.partial.versions):
                raise InvariantError(f"request {r.req_id} resumed on engine {sub.engine} at version {e.version}, "
                                     f"older than its tokens so far (version {max(r.partial.versions)})")
            if r.v_traj < 0:
                r.v_traj = e.version
            r.state, r.engine, r.version = "running", sub.engine, e.version
            self.emit(Event("request_admitted", v.now, engine=sub.engine, req_id=r.req_id, group_id=r.group_id,
                            version=e.version))
        e.assigned += len(reqs)
        backend.submit(sub.engine, reqs, {r.group_id: self.prompts[r.group_id] for r in reqs})

    def train(self, backend: Backend, call: TrainCall, gids: list[int]) -> None:
        v = self.v
        groups = []
        for gid in gids:
            g = v.groups[gid]
            if g.consumed or not g.materialized:
                raise InvariantError(f"group {gid} handed to the trainer "
                                     f"{'twice' if g.consumed else 'before it was materialised'}")
            for t in g.trajectories:
                if self.max_staleness is not None and v.trainer.version - t.version > self.max_staleness:
                    raise InvariantError(f"group {gid} sample {t.sample_index} (version {t.version}) handed to the "
                                         f"trainer at version {v.trainer.version}: staleness above the bound "
                                         f"{self.max_staleness}")
                key = (gid, t.sample_index)
                if key in self.trained:
                    raise InvariantError(f"trajectory {key} trained twice")
                self.trained.add(key)
            g.consumed = True
            groups.append(Group(gid, g.prompt_index, g.answer, sorted(g.trajectories, key=lambda t: t.sample_index)))
        v.trainer.busy = True
        v.trainer.groups_consumed += len(gids)
        v.trainer.groups_since_step += len(gids)
        self.emit(Event("train_started", v.now, version=v.trainer.version,
                        data={"groups": gids, "step": call.step, "publish": call.publish}))
        backend.train(call, groups)
        self.prune()

    def prune(self) -> None:
        """Forget rounds that are fully consumed (older than the current one), so long runs stay bounded."""
        v = self.v
        for r in [r for r in v.round_groups if r < v.round]:
            if all(v.groups[g].closed for g in v.round_groups[r]):
                v.plans.pop(r, None)
                for g in v.round_groups.pop(r):
                    del v.groups[g]
                    self.prompts.pop(g, None)
                for rid in [i for i, q in v.requests.items() if q.round == r]:
                    del v.requests[rid]

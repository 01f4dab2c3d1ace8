"""The controller: owns the policy objects and is their only caller. Driven by a Backend — the runtime
(torch.distributed ranks, runtime/backend.py) or the simulator (virtual clock, sim/backend.py) — through the same
five calls.

Loop: take the next event (with every event that arrived together with it), fold it into the views, then ask each
mechanism for decisions (a Design once for all the kinds it fills) and hand them to the backend. Every change of
the views goes through the request lifecycle (sched/lifecycle.py), which also checks the invariants every preset
must keep, so a buggy policy fails loudly in tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from rl.types import Group
from sched.base import InvariantError, Preset
from sched.decisions import (AddEngines, Abort, Interrupt, Joint, LendEngines, LoadWeights, Migrate, Reshard,
                             ResetEngine, ReturnEngines, RoundPlan, Submit, TrainCall)
from sched.events import Event, EventLog
from sched.lifecycle import Lifecycle
from sched.partials import PartialPool
from sched.resources import EngineView
from sched.resume import load_views, save_views
from sched.views import Request, Views


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
    def command(self, cmd: Abort | Interrupt | LoadWeights | ResetEngine) -> None: ...
    def train(self, call: TrainCall, groups: list[Group]) -> None: ...
    def next_event(self) -> Event: ...  # blocks until one is available (the backend enforces its own deadline)
    # optional attributes: `colocated` (engines and trainer share GPUs), `elastic` (it takes LendEngines /
    # ReturnEngines / AddEngines / Reshard: an engine's GPUs join the trainer, the pool scales out or changes TP; the
    # simulator can, our runtime's fixed process groups cannot), both False by default; `decode_profile`
    # (sched.resources.DecodeProfile); `tp` (GPUs per engine, default 1) and `tp_sizes` (those it can reshard to);
    # `isolates_faults` (its engines stream their requests' tokens so far and report `engine_failed` instead of
    # failing the run, so the controller keeps the partial-response pool, sched/partials.py; the runtime's can).
    # optional: `has_pending() -> bool`, whether next_event would return at once with an event that arrived
    # together with the last one (the runtime's engines send one message per step); the controller applies such
    # a batch before deciding once. Backends without it (the simulator) are decided on after every event.


__all__ = ["Backend", "Controller", "InvariantError", "PromptItem"]

_NO_DESIGN = Joint()   # the decisions of a preset without a Design: every kind asked of its own mechanism (read only)


class Controller:
    def __init__(self, preset: Preset, source: Callable[[int], list[PromptItem]], group_size: int,
                 prompts_per_step: int, total_steps: int, log: EventLog | None = None,
                 total_samples: int | None = None):
        self.preset = preset
        self.source = source
        self.total_steps = total_steps
        self.total_samples = total_samples   # a budget in trained samples instead of steps (train.samples)
        self.log = log or EventLog()
        self.v = Views(group_size=group_size, prompts_per_step=prompts_per_step)
        self.life = Lifecycle(self.v, self.emit)
        self.max_staleness: int | None = preset.staleness_bound()

    # ---------------------------------------------------------------------------------------------- main loop
    @property
    def done(self) -> bool:
        return self.spent() and not self.v.trainer.busy

    def spent(self) -> bool:
        """The budget is used up: `total_steps` optimizer steps taken or, with `total_samples`, that many samples
        handed to the trainer and the step over them taken (no gradients are left accumulated unapplied: a preset
        that steps once per round finishes the round), so every preset trains the same samples, rounded up to
        its optimizer batch."""
        t = self.v.trainer
        if self.total_samples is None:
            return t.steps_done >= self.total_steps
        return t.samples_consumed >= self.total_samples and t.groups_since_step == 0

    def intake_closed(self) -> bool:
        """No new prompts enter the pipeline: the budget's last step is taken or its last samples are handed over."""
        if self.total_samples is None:
            return self.v.trainer.steps_done >= self.total_steps
        return self.v.trainer.samples_consumed >= self.total_samples

    def run(self, backend: Backend, after_event: Callable[[Event], None] | None = None) -> Views:
        """Drive the policies until the budget is spent (`total_steps` optimizer steps, or `total_samples` trained
        samples). `after_event` runs after each event is applied and decided on (the runtime checkpoints there at
        step boundaries)."""
        if not self.v.engines:
            self.v.engines = [EngineView(engine=i) for i in range(backend.num_engines)]
        self.v.elastic = bool(getattr(backend, "elastic", False))
        self.v.colocated = bool(getattr(backend, "colocated", False))
        self.v.tp = int(getattr(backend, "tp", 1))
        self.v.tp_sizes = tuple(getattr(backend, "tp_sizes", ()))
        self.v.kv_block_size = int(getattr(backend, "kv_block_size", 0))
        self.v.switch_s = float(getattr(backend, "switch_s", 0.0))
        self.v.decode_profile = getattr(backend, "decode_profile", None)
        if getattr(backend, "isolates_faults", False) and self.life.fold.partials is None:
            self.life.fold.partials = PartialPool()
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
        self.log_stats()
        self.log.flush()
        return self.v

    def log_stats(self) -> None:
        """Each mechanism's counters (Policy.stats) as one `policy_stats` event, at the end of a run."""
        stats = {k: s for k, p in self.preset.policies().items() if (s := p.stats())}
        if stats:
            self.emit(Event("policy_stats", self.v.now, data=stats))

    def apply(self, ev: Event) -> None:
        self.life.fold.apply(ev)

    def emit(self, ev: Event) -> None:
        self.log.write(ev)

    def quiescent(self) -> bool:
        """Nothing generated-but-unconsumed and nothing in flight: a checkpoint needs no trajectory state."""
        return self.v.in_flight() == 0 and not self.v.open_groups() and not self.v.trainer.busy

    # ---------------------------------------------------------------------------------------------- decisions
    def decide(self, backend: Backend) -> None:
        p, v = self.preset, self.v
        if self.life.fold.resets:
            resets, self.life.fold.resets = self.life.fold.resets, []
            for engine in resets:
                backend.command(ResetEngine(engine))
        plan = 0 if self.intake_closed() else p.dispatch.intake(v)
        if isinstance(plan, RoundPlan) or plan > 0:
            self.start_round(plan)
        for sub, src in self.life.due_migrations():   # migrated requests land before any other admission
            self.submit(backend, sub)
            self.life.migrated(sub, src)
        joint = p.design.decide(v) if p.design is not None else _NO_DESIGN   # a Design decides its kinds at once
        for sub in p.dispatch.admit(v) if joint.submit is None else joint.submit:
            self.submit(backend, sub)
        for cmd in p.rebalance.plan(v) if joint.rebalance is None else joint.rebalance:
            self.command(backend, cmd)
        for cmd in p.handoff.evict(v):
            self.command(backend, cmd)
        if not v.trainer.busy and not self.spent():
            gids = p.handoff.ready(v)
            if gids:
                self.train(backend, p.update.decide(gids, v), gids)
        for cmd in p.weight_sync.engines_to_load(v) if joint.weight_sync is None else joint.weight_sync:
            self.command(backend, cmd)

    def start_round(self, plan: int | RoundPlan) -> None:
        plan = plan if isinstance(plan, RoundPlan) else RoundPlan(fresh=int(plan))
        items = list(plan.prompts) + (self.source(plan.fresh) if plan.fresh > 0 else [])
        self.life.start_round(plan, items)

    def submit(self, backend: Backend, sub: Submit) -> None:
        reqs = self.life.admit(sub)
        backend.submit(sub.engine, reqs, {r.group_id: self.v.groups[r.group_id].prompt for r in reqs})

    def command(self, backend: Backend,
                cmd: Abort | Interrupt | Migrate | LoadWeights | LendEngines | ReturnEngines | AddEngines | Reshard
                ) -> None:
        if isinstance(cmd, (LendEngines, ReturnEngines, AddEngines, Reshard)):
            pool = self.life.pool
            {LendEngines: pool.lend, ReturnEngines: pool.give_back, AddEngines: pool.add_engines,
             Reshard: pool.reshard}[type(cmd)](cmd)
            backend.command(cmd)
            return
        if isinstance(cmd, Abort):
            sends: list[Abort | Interrupt] = list(self.life.abort(cmd))
        elif isinstance(cmd, Interrupt):
            sends = list(self.life.interrupt(cmd.req_ids))
        elif isinstance(cmd, Migrate):
            sends = list(self.life.migrate(cmd))
        elif isinstance(cmd, LoadWeights):
            self.life.load_weights(cmd)
            backend.command(cmd)
            return
        else:
            raise TypeError(f"unknown decision {cmd!r}")
        for c in sends:
            backend.command(c)

    def train(self, backend: Backend, call: TrainCall, gids: list[int]) -> None:
        groups = self.life.consume(gids, self.max_staleness)
        self.emit(Event("train_started", self.v.now, version=self.v.trainer.version,
                        data={"groups": gids, "step": call.step, "publish": call.publish}))
        backend.train(call, groups)
        self.life.prune()

    # --------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        t = self.v.trainer
        return {"round": self.v.round,
                "trainer": {"version": t.version, "steps_done": t.steps_done, "groups_consumed": t.groups_consumed,
                            "samples_consumed": t.samples_consumed},
                "views": save_views(self.life),
                "policies": {k: p.state_dict() for k, p in self.preset.policies().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.v.round = state["round"]
        t = self.v.trainer
        t.version, t.steps_done = state["trainer"]["version"], state["trainer"]["steps_done"]
        t.groups_consumed = state["trainer"]["groups_consumed"]
        t.samples_consumed = state["trainer"].get("samples_consumed", 0)
        load_views(self.life, state["views"])
        for k, p in self.preset.policies().items():
            p.load_state_dict(state["policies"].get(k, {}))

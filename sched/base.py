"""The policy interface: views in, decisions out. No tensors, sockets or clocks here.

A scheduling policy is five small objects, one per mechanism kind:

    dispatch     which prompts enter the pipeline and which waiting request goes to which engine, and when
    handoff      when materialised groups become a training batch
    update       whether the trainer steps the optimizer on that batch, and whether it then publishes weights
    weight_sync  when an engine adopts a published version
    rebalance    abort / interrupt / migrate running trajectories; lend engines to the trainer and take them back;
                 scale the rollout pool out, or reshard it to another tensor-parallel size

Each reads `Views` (the controller's picture of requests, groups, engines and trainer, sched/views.py) and returns
plain decisions (the dataclasses of sched/decisions.py). The controller (sched/controller.py) is the only caller. A
paper that decides several kinds together on one picture is a `Design`: one object filling those kinds. A
`Preset` names one mechanism per kind; a mechanism class registers itself with the bare decorator `@register`, which
reads its `kind` and `name`, and takes its parameters as a `Params` dataclass that `build_policy` fills from a
config table through the one config validator (sched/build.py, config.build).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from sched.views import Views

if TYPE_CHECKING:
    from sched.decisions import (AddEngines, Abort, Interrupt, Joint, LendEngines, LoadWeights, Migrate, Reshard,
                                 ReturnEngines, RoundPlan, Submit, TrainCall)


class InvariantError(RuntimeError):
    """A policy made a decision that breaks a rule every preset must keep."""


# ----------------------------------------------------------------------------------------------- mechanisms


class Policy:
    """Base of every mechanism. `Params` is the module's parameter dataclass (validated from the config);
    `paper` names the paper section it implements (`python -m sched` lists them)."""
    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    # reads each running request's tokens so far from the engines' counters (`tokens_decoded` data `progress`,
    # folded into Views request.tokens): the engines report it only when a preset's mechanism says so
    reads_progress: ClassVar[bool] = False
    # leaves failed engines (EngineView.failed) out of what it places, loads or moves: every mechanism of a preset
    # that isolates engine faults must (a hand-off or an update never touches an engine)
    skips_failed_engines: ClassVar[bool] = False
    # reads the engines' counters (KV blocks used / free, waiting, preemptions: EngineView) on a clock: the
    # simulator's engines then report them every counters_period_s() of virtual time (the runtime's always report)
    reads_counters: ClassVar[bool] = False

    @dataclass
    class Params:
        pass

    def __init__(self, params: Any = None):
        self.p = params if params is not None else self.Params()

    def bind(self, preset: "Preset") -> None:
        """Called once when the preset is assembled. A Design takes its parts here, a part of a coupled design
        (StaleFlow's, AReaL's hand-off) its partner; either raises ValueError if the preset lacks them."""

    def state_dict(self) -> dict[str, Any]:
        """Anything the policy must carry across a checkpoint/resume (most policies are stateless)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def staleness_bound(self) -> int | None:
        """The largest staleness (trainer version minus a trajectory's oldest token version, at hand-off) this
        mechanism guarantees, or None. The controller enforces the smallest bound of a preset's mechanisms."""
        return None

    def counters_period_s(self) -> float | None:
        """How fresh the engines' counters (`tokens_decoded`) must be for this mechanism, in seconds: a busy engine
        reports at least this often (besides every few engine steps). None: it does not read them on a clock."""
        return None

    def stats(self) -> dict[str, float]:
        """Counters a researcher reads after the run (the controller logs them once, at its end, as a
        `policy_stats` event: summary.json's `policy_stats`). Default: none."""
        return {}

    def failures_isolated(self) -> int:
        """How many failures of one engine this mechanism recovers from (Laminar §3.3: the engine's trajectories
        resume elsewhere from the partial-response pool and it rejoins once rebuilt; past the count it is retired
        and the run goes on without it). 0: it does not isolate engine faults (a failure ends the run)."""
        return 0


class Dispatch(Policy):
    kind = "dispatch"

    def intake(self, v: Views) -> "int | RoundPlan":
        """How many new prompts to pull into the pipeline now (0: none), or a `RoundPlan`. Default: synchronous
        rounds — a new round of `prompts_per_step` prompts once the last one is fully closed (trained or void) and
        every engine holds the latest weights."""
        if v.round >= 0 and any(not v.groups[g].closed for g in v.round_groups.get(v.round, [])):
            return 0
        if v.trainer.busy or not v.engines_at(v.trainer.version):
            return 0
        return v.prompts_per_step

    def admit(self, v: Views) -> list[Submit]:
        raise NotImplementedError



class Handoff(Policy):
    kind = "handoff"
    skips_failed_engines = True

    def ready(self, v: Views) -> list[int] | None:
        """Group ids that form the next training batch, or None."""
        raise NotImplementedError

    def evict(self, v: Views) -> list[Abort]:
        """Aborts (requeue=False) of whole materialised groups the buffer has no room for, at every decision,
        before `ready`; their samples are dropped and counted, never trained. Default: none."""
        return []

    def batch_groups(self, prompts_per_step: int) -> int | None:
        """Groups in one train call it forms, for a run of `prompts_per_step` prompts per round; None: as many as
        have materialised (a streaming hand-off). What a run budget's start-up line reads (runtime/budget.py)."""
        return None


class Update(Policy):
    kind = "update"
    skips_failed_engines = True

    def decide(self, group_ids: list[int], v: Views) -> TrainCall:
        raise NotImplementedError

    def step_groups(self, batch: int | None, prompts_per_step: int) -> int | None:
        """Groups per optimizer step, given the hand-off's train-call size `batch` (Handoff.batch_groups); None:
        not known from the configuration. Default: one step per train call."""
        return batch


class WeightSync(Policy):
    kind = "weight_sync"
    keeps_kv = False   # its loads keep running sequences' KV (LoadWeights.keep_kv); colocated mode, whose engines
    #                    are refreshed in place at each publication with no LoadWeights to say it, reads this

    def engines_to_load(self, v: Views) -> list[LoadWeights | Interrupt]:
        """LoadWeights for engines that adopt a published version now (an engine may be busy: its running
        sequences keep their tokens and continue under the new weights, their KV recomputed, or kept with
        `keep_kv`), optionally preceded by Interrupts."""
        raise NotImplementedError


class Rebalance(Policy):
    kind = "rebalance"

    def plan(self, v: Views) -> list[Abort | Interrupt | Migrate | LendEngines | ReturnEngines | AddEngines | Reshard]:
        return []


class Design(Policy):
    """A composite mechanism: one object filling several kinds, for a paper that decides them together (StaleFlow's
    Algorithm 1: sync, migrate, route on one snapshot). It is the preset's mechanism of one kind (its table holds the
    parameters) and takes the preset's mechanisms of its other kinds as parts at bind (they keep names and tables).
    The controller calls `decide` once per round, where it would ask Dispatch.admit, and issues each filled kind's
    decisions (Joint) where it would ask that kind; unfilled ones (None), intake and the hand-off: asked as usual."""

    def decide(self, v: Views) -> Joint:
        raise NotImplementedError


KIND_BASES: dict[str, type[Policy]] = {
    "dispatch": Dispatch, "handoff": Handoff, "update": Update, "weight_sync": WeightSync, "rebalance": Rebalance}
REGISTRY: dict[str, dict[str, type[Policy]]] = {k: {} for k in KIND_BASES}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a mechanism selectable by `[sched.<kind>] name = "<name>"`."""
    if cls.kind not in REGISTRY or not cls.name or not cls.paper:
        raise TypeError(f"{cls.__name__} needs a known `kind`, a `name` and a `paper` section")
    if cls.name in REGISTRY[cls.kind]:
        raise TypeError(f"{cls.__name__}: a {cls.kind} named {cls.name!r} is registered already "
                        f"({REGISTRY[cls.kind][cls.name].__module__})")
    REGISTRY[cls.kind][cls.name] = cls
    return cls


@dataclass
class Preset:
    """One mechanism per kind; assembling a preset binds its coupled mechanisms to each other (Policy.bind)."""
    dispatch: Dispatch
    handoff: Handoff
    update: Update
    weight_sync: WeightSync
    rebalance: Rebalance
    design: Design | None = field(default=None, init=False, repr=False)   # the mechanism that is a Design, if any

    def __post_init__(self) -> None:
        for p in self.policies().values():
            p.bind(self)
        self.design = next((p for p in self.policies().values() if isinstance(p, Design)), None)
        if self.failures_isolated():
            blind = [f"{k} {p.name!r}" for k, p in self.policies().items() if not p.skips_failed_engines]
            if blind:
                raise ValueError(f"this preset isolates engine faults ({self.isolator()}) but {', '.join(blind)} "
                                 f"would still place, load or move work on a failed engine (skips_failed_engines)")

    def failures_isolated(self) -> int:
        """Failures per engine its mechanisms recover from (Policy.failures_isolated; the smallest nonzero);
        0: none."""
        counts = [n for p in self.policies().values() if (n := p.failures_isolated()) > 0]
        return min(counts) if counts else 0

    def isolator(self) -> str:
        return ", ".join(f"{k} {p.name!r}" for k, p in self.policies().items() if p.failures_isolated())

    def policies(self) -> dict[str, Policy]:
        return {k: getattr(self, k) for k in KIND_BASES}

    def reads_progress(self) -> bool:
        """Whether any of its mechanisms reads the engines' per-request progress (Policy.reads_progress)."""
        return any(p.reads_progress for p in self.policies().values())

    def reads_counters(self) -> bool:
        """Whether any of its mechanisms reads the engines' counters on a clock (Policy.reads_counters)."""
        return any(p.reads_counters for p in self.policies().values())

    def counters_period_s(self) -> float | None:
        """The shortest counters period its mechanisms ask for (Policy.counters_period_s), or None."""
        periods = [t for p in self.policies().values() if (t := p.counters_period_s()) is not None]
        return min(periods) if periods else None

    def groups_per_step(self, prompts_per_step: int) -> int | None:
        """Its optimizer batch in groups (the update's reading of the hand-off's train calls, Update.step_groups),
        for a run of `prompts_per_step` prompts per round; None: not known from the configuration."""
        return self.update.step_groups(self.handoff.batch_groups(prompts_per_step), prompts_per_step)

    def staleness_bound(self) -> int | None:
        """The tightest staleness bound its mechanisms declare (None: unbounded or on-policy by construction)."""
        bounds = [b for p in self.policies().values() if (b := p.staleness_bound()) is not None]
        return min(bounds) if bounds else None

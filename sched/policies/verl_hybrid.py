"""verl's dynamic resource scheduling for fully-async training, in the simulator (verl
`docs/advance/dynamic_schedule.md`; use with `[rebalance] name = "verl_hybrid"` over a fully-async preset whose
dispatch and weight sync leave lent engines alone, e.g. `pipelinerl`).

    verl_hybrid  rebalance  the last `hybrid` engines are verl's Hybrid replicas: GPUs the trainer shares; they roll
                            out while the buffer lacks samples and go back to the trainer before it trains

Only where the backend can move GPUs between rollout and the trainer (`Views.elastic`: the simulator). Our real ranks
have fixed process groups (FSDP2 over the train ranks, built at launch), so on them it does nothing and every engine
stays in rollout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import Preset, Rebalance, register
from sched.decisions import Interrupt, LendEngines, ReturnEngines
from sched.views import S, Views

# verl's default policy (default_policy.py): the switch cost before one is measured, and the time per waited-on
# sample before any cycle has waited (pessimistic: it favours activation until real waits narrow it)
SWITCH_COST_S, INITIAL_PER_SAMPLE_S = 10.0, 1000.0


@register
class VerlHybrid(Rebalance):
    """Hybrid + Standalone inference replicas (verl `docs/advance/dynamic_schedule.md`, "Dynamic Resource Scheduling
    for Fully-Async Training", its `fixed_ratio` and `default` policies, verl/experimental/fully_async_policy/
    dynamic_schedule/): the engines other than the last `hybrid` are Standalone, always rolling out; the last
    `hybrid` are Hybrid, on GPUs the trainer shares.

    Deactivation (before training): once the buffer holds deactivate_ratio x one batch of samples (materialised,
    not yet trained; verl: deactivate_ratio x required_samples x trigger_parameter_sync_step, one sync per batch
    here), every request on a Hybrid engine is interrupted (verl aborts them and its partial-rollout retries resume
    them on Standalone replicas; here they keep their tokens and the dispatch resumes them on a Standalone engine)
    and the Hybrid engines are lent to the trainer (`LendEngines`): the train calls that start while they are lent
    run on their GPUs too. Activation (after a weight sync): at each publication, if the buffer holds fewer than
    deactivate_ratio x one batch of samples (a positive gap, `_deactivate_gap`: `fixed_ratio`'s pure gap check),
    they return to rollout (`ReturnEngines`) and adopt the newest weights; otherwise they stay with the trainer and
    get no weights (verl skips that sync).

    `policy = "default"` (verl's recommended one) adds, after each publication's decision, the adaptive ratio: if
    the trainer had to wait on newly generated samples in the cycle (`wait_samples`: a batch less what was buffered
    when it came free, summed over the cycle's calls), ratio += clip(wait_samples / batch, 0.02, 0.1), capped at
    1; else ratio -= 0.02 (deactivate earlier). And a cost/benefit gate on activation: only if gap x the time per
    waited sample (the cycle's wait seconds / wait_samples; 1000 s until a cycle has waited) exceeds the switch
    cost, the mean of the last 3 measured activate + deactivate times, 10 s until one is measured. Here each switch
    takes the backend's `Views.switch_s` (the simulator's cost.switch_s: a lent engine's GPUs join the trainer, and a
    returned engine decodes again, that long after the decision), so the measured cost is twice it; verl records
    only positive times, so at 0 the cost stays at the 10 s fallback.

    Not modelled: `dynamic_schedule_enable_rebalance` (re-spreading all in-flight requests after an activation).
    Hybrid engines start in rollout (verl's first step activates them: the buffer starts empty).

    Invariant kept: at most one switch per decision; Hybrid engines are lent only once nothing runs on them
    (their requests interrupted first, nothing dropped); no train call the hand-off can form starts while they are
    in rollout, as deactivation comes at deactivate_ratio <= 1 batch, before the hand-off has one."""
    name = "verl_hybrid"
    paper = "verl dynamic resource scheduling (docs/advance/dynamic_schedule.md, fixed_ratio policy)"

    @dataclass
    class Params:
        hybrid: int = F(1, ge=1, help="engines on GPUs the trainer shares (verl's Hybrid replicas): the last "
                                      "`hybrid` engine ids; the others are Standalone")
        deactivate_ratio: float = F(0.3, gt=0.0, le=1.0, help="Hybrid engines go back to the trainer once this "
                                    "share of a batch of samples is buffered (verl's dynamic_schedule_deactivate_"
                                    "ratio, default 0.3; `default` adapts it)")
        policy: str = F("fixed_ratio", choices=("fixed_ratio", "default"),
                        help="verl's dynamic_schedule_policy: fixed_ratio = a fixed ratio and a pure gap check | "
                             "default = the ratio adapted to the trainer's waits and a cost/benefit gate on "
                             "activation")

    def __init__(self, params: "VerlHybrid.Params | None" = None):
        super().__init__(params)
        self.active = True          # the Hybrid engines are in rollout
        self.seen = -1              # the publication last acted on
        self.switches = {"deactivated": 0, "activated": 0, "interrupted": 0, "gated": 0}
        self.batch: Any = None
        self.ratio = self.p.deactivate_ratio
        self.per_sample_s = INITIAL_PER_SAMPLE_S     # `default`: the time per waited-on sample, last measured
        self.wait_s = 0.0                            # this cycle's trainer waits (seconds) and samples waited on
        self.wait_samples = 0
        self.idle: tuple[float, int] | None = None  # (when the trainer came free, samples buffered then)

    def bind(self, preset: Preset) -> None:
        self.batch = preset.handoff.batch_groups

    def hybrids(self, v: Views) -> list[int]:
        n = len(v.engines)
        if self.p.hybrid >= n:
            raise ValueError(f"sched.rebalance.hybrid = {self.p.hybrid} leaves no Standalone engine of {n}: "
                             f"set it below {n}")
        return list(range(n - self.p.hybrid, n))

    def plan(self, v: Views) -> list[Interrupt | LendEngines | ReturnEngines]:
        if not v.elastic:
            return []
        H = self.hybrids(v)
        need = ((self.batch(v.prompts_per_step) if self.batch is not None else None) or v.prompts_per_step) \
            * v.group_size
        buffered = sum(g.scored for g in v.ready_groups())
        self._track_waits(v, buffered, need)
        if self.active:
            if buffered < max(0, int(self.ratio * need)):    # verl's deactivate_wait_samples
                return []
            by_engine: dict[int, list[int]] = {}
            for r in sorted(v.requests.in_state(S.RUNNING), key=lambda r: r.req_id):
                if r.engine in H:
                    by_engine.setdefault(r.engine, []).append(r.req_id)
            self.active = False
            self.seen = v.trainer.published
            self.switches["deactivated"] += 1
            self.switches["interrupted"] += sum(len(ids) for ids in by_engine.values())
            return [*(Interrupt(e, ids) for e, ids in sorted(by_engine.items())), LendEngines(H)]
        if v.trainer.published > self.seen and not v.trainer.busy:
            self.seen = v.trainer.published
            gap = self.ratio * need - buffered                # verl's _deactivate_gap
            go = gap > 0 and (self.p.policy == "fixed_ratio" or self._worth_it(gap, v))
            self.switches["gated"] += gap > 0 and not go
            if self.p.policy == "default":
                self._adapt(need)
            if go:
                self.active = True
                self.switches["activated"] += 1
                return [ReturnEngines(H)]
        return []

    def _track_waits(self, v: Views, buffered: int, need: int) -> None:
        """A cycle's waits: when the trainer comes free, the samples then buffered; when a batch is there for it
        (the hand-off takes it in this decision), the seconds it waited and the samples it waited on."""
        if v.trainer.busy:
            self.idle = None
            return
        if self.idle is None:
            self.idle = (v.now, buffered)
        if buffered >= need:
            since, had = self.idle
            if had < need:
                self.wait_s += v.now - since
                self.wait_samples += need - had
            self.idle = (v.now, need)      # what it waits for from here is the next batch

    def _worth_it(self, gap: float, v: Views) -> bool:
        """`default`'s cost/benefit gate: the gap's estimated seconds against the switch's cost (an activation and
        a deactivation, each `Views.switch_s` when the backend reports it, else verl's fallback)."""
        if self.wait_s > 0 and self.wait_samples > 0:
            self.per_sample_s = self.wait_s / self.wait_samples
        cost = 2 * v.switch_s if v.switch_s > 0 else SWITCH_COST_S
        return gap * self.per_sample_s - cost > 0

    def _adapt(self, need: int) -> None:
        """`default`'s ratio update after a weight sync, from the cycle's samples waited on; a new cycle starts."""
        if self.wait_samples > 0:
            self.ratio = min(1.0, self.ratio + min(0.1, max(0.02, self.wait_samples / need)))
        else:
            self.ratio -= 0.02
        self.wait_s, self.wait_samples = 0.0, 0

    def stats(self) -> dict[str, float]:
        return {**{k: float(n) for k, n in self.switches.items()}, "deactivate_ratio": self.ratio}

    def state_dict(self) -> dict[str, Any]:
        return {"active": self.active, "seen": self.seen, "ratio": self.ratio, "per_sample_s": self.per_sample_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.active, self.seen = bool(state.get("active", True)), int(state.get("seen", -1))
        self.ratio = float(state.get("ratio", self.p.deactivate_ratio))
        self.per_sample_s = float(state.get("per_sample_s", INITIAL_PER_SAMPLE_S))

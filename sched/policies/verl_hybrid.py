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


@register
class VerlHybrid(Rebalance):
    """Hybrid + Standalone inference replicas (verl `docs/advance/dynamic_schedule.md`, "Dynamic Resource Scheduling
    for Fully-Async Training", its `fixed_ratio` policy): the engines other than the last `hybrid` are Standalone,
    always rolling out; the last `hybrid` are Hybrid, on GPUs the trainer shares.

    Deactivation (before training): once the buffer holds deactivate_ratio x one batch of samples (materialised,
    not yet trained; verl: deactivate_ratio x required_samples x trigger_parameter_sync_step, one sync per batch
    here), every request on a Hybrid engine is interrupted (verl aborts them and its partial-rollout retries resume
    them on Standalone replicas; here they keep their tokens and the dispatch resumes them on a Standalone engine)
    and the Hybrid engines are lent to the trainer (`LendEngines`): the train calls that start while they are lent
    run on their GPUs too. Activation (after a weight sync): at each publication, if the buffer holds less than one
    batch (a positive gap: `fixed_ratio`'s pure gap check), they return to rollout (`ReturnEngines`) and adopt the
    newest weights; otherwise they stay with the trainer and get no weights (verl skips that sync).

    Not modelled: verl's `default` policy's adaptive ratio and cost/benefit gate, the switch's own time (offload,
    wake-up), and `dynamic_schedule_enable_rebalance` (re-spreading all in-flight requests after an activation).
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
                                    "ratio, default 0.3)")

    def __init__(self, params: "VerlHybrid.Params | None" = None):
        super().__init__(params)
        self.active = True          # the Hybrid engines are in rollout
        self.seen = -1              # the publication last acted on
        self.switches = {"deactivated": 0, "activated": 0, "interrupted": 0}
        self.batch: Any = None

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
        if self.active:
            if buffered < self.p.deactivate_ratio * need:
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
            if buffered < need:
                self.active = True
                self.switches["activated"] += 1
                return [ReturnEngines(H)]
        return []

    def stats(self) -> dict[str, float]:
        return {k: float(n) for k, n in self.switches.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"active": self.active, "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.active, self.seen = bool(state.get("active", True)), int(state.get("seen", -1))

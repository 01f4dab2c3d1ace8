"""PipelineRL's trainer intake: batches in arrival order, `max_lag` counted or enforced (arXiv 2509.19128)."""
from __future__ import annotations

from dataclasses import dataclass

from config import F
from sched.base import Handoff, Preset, register
from sched.decisions import Abort
from sched.views import GroupState, Views


@register
class PipelineRLHandoff(Handoff):
    """The trainer takes `groups` (B) materialised groups per batch in the order they materialised (PipelineRL's
    preprocessor and trainer read the actors' stream in arrival order); a batch waits until B are there.

    `max_lag` is the `lag_cap` dispatch's `lag` (one design, one parameter). PipelineRL's trainer
    (`pipelinerl/finetune_loop.py`) checks each batch against it and, in its words, does not "drop but count": a
    sample more than max_lag versions behind the trainer is trained and counted (`samples_too_old_to_train`). That
    is `too_old = "count"` (the stat `too_old_trained`). The admission cap alone does not bound staleness: a
    straggler can be overtaken by groups started after it, since the cap grows with every version. `too_old =
    "drop"` is the reading that enforces the bound (samples staler than max_lag are not trained): before every
    batch, whole materialised groups with a sample more than max_lag versions behind the trainer are dropped
    (Abort, requeue=False; the stat `too_old_dropped`), and the preset declares the bound, which the controller
    checks.

    Invariant kept: batches are exactly B whole materialised groups, each handed over once; with "drop", no sample
    is trained more than max_lag versions after its oldest token's version."""
    name = "pipelinerl"
    paper = "PipelineRL trainer intake and max_lag (arXiv 2509.19128; pipelinerl/finetune_loop.py)"

    @dataclass
    class Params:
        groups: int = F(0, ge=0, help="B: groups per training batch (0: the run's prompts_per_step)")
        too_old: str = F("count", choices=("count", "drop"),
                         help="samples more than max_lag versions behind the trainer: trained and counted "
                              "(PipelineRL's finetune loop) or dropped before the batch (the bound enforced)")

    def __init__(self, params: "PipelineRLHandoff.Params | None" = None):
        super().__init__(params)
        self.max_lag = 0
        self.trained_too_old = 0      # samples trained more than max_lag versions behind ("count")
        self.dropped_too_old = 0      # samples dropped for it ("drop")

    def bind(self, preset: Preset) -> None:
        if preset.dispatch.name != "lag_cap":
            raise ValueError(f"the pipelinerl handoff takes max_lag from the lag_cap dispatch; this preset's "
                             f"dispatch is {preset.dispatch.name!r}")
        self.max_lag = int(preset.dispatch.p.lag)

    def staleness_bound(self) -> int | None:
        return self.max_lag if self.p.too_old == "drop" else None

    def _too_old(self, g: GroupState, w: int) -> int:
        return sum(1 for t in g.trajectories if w - t.version > self.max_lag)

    def evict(self, v: Views) -> list[Abort]:
        if self.p.too_old != "drop":
            return []
        w = v.trainer.version
        stale = [g for g in v.ready_groups() if self._too_old(g, w)]
        self.dropped_too_old += sum(len(g.trajectories) for g in stale)
        return [Abort(-1, [rid for g in stale for rid in g.req_ids])] if stale else []

    def ready(self, v: Views) -> list[int] | None:
        B = self.p.groups or v.prompts_per_step
        if v.groups.count_ready() < B:
            return None
        batch = sorted(v.ready_groups(), key=lambda g: (g.materialized_seq, g.group_id))[:B]
        self.trained_too_old += sum(self._too_old(g, v.trainer.version) for g in batch)
        return [g.group_id for g in batch]

    def batch_groups(self, prompts_per_step: int) -> int | None:
        return self.p.groups or prompts_per_step

    def stats(self) -> dict[str, float]:
        return {"too_old_trained": float(self.trained_too_old), "too_old_dropped": float(self.dropped_too_old)}

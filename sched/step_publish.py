"""Step-and-publish update: every training batch is one optimizer step followed by a weight publication
(the synchronous baseline; with whole-round handoff this is one step per rollout round).

Invariant kept: the published version counts optimizer steps, so engines never see a half-applied update.
"""
from __future__ import annotations

from sched.base import TrainCall, Update, Views, register


@register
class StepAndPublish(Update):
    name = "step_publish"

    def decide(self, group_ids: list[int], v: Views) -> TrainCall:
        return TrainCall(group_ids, step=True, publish=True)

"""Whole-round handoff: the synchronous baseline's barrier (RolloutPipe §2.1 "Slime submits all groups ...
only at rollout completion").

The trainer gets nothing until every group of the current round is materialised (or void: every sample dropped,
as a prompt deferred by tail batching), then gets all the materialised ones.
Invariant kept: a batch is exactly one round, so all its samples share the round's generating version.
"""
from __future__ import annotations

from sched.base import Handoff, Views, register


@register
class WholeRound(Handoff):
    name = "whole_round"

    def ready(self, v: Views) -> list[int] | None:
        if v.round < 0 or not v.round_done(v.round):
            return None
        gids = [g for g in v.round_groups[v.round] if v.groups[g].materialized and not v.groups[g].consumed]
        return gids or None

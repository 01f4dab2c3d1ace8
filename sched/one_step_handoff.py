"""Oldest-round handoff: the one-step pipeline's batch (VeRL-Pipeline; StreamRL §4.1 strawman 2).

With k-step-off rounds (sched/one_step.py) a later round is already generating while an earlier one waits for the
trainer, so "the current round" (whole_round's barrier) is the wrong one: the trainer gets the OLDEST round that is
not yet trained, whole, once every group of it is materialised (or void), and never a group of a newer round
before it. One batch per round; with `step_publish`, one optimizer step and one publication per round.

Invariant kept: a batch is exactly one round's materialised groups, rounds are trained in order, each once.
"""
from __future__ import annotations

from sched.base import Handoff, Views, register


@register
class OldestRound(Handoff):
    name = "oldest_round"

    def ready(self, v: Views) -> list[int] | None:
        for r in sorted(v.round_groups):
            gids = v.round_groups[r]
            if all(v.groups[g].closed for g in gids):
                continue
            if not v.round_done(r):
                return None
            return [g for g in gids if v.groups[g].materialized and not v.groups[g].consumed] or None
        return None

"""Complete-group pipelining (CGP) handoff: RolloutPipe §3.2, Algorithm 1 lines 13-19.

Under GRPO the trainable unit is the complete, materialised group (rewards of all K samples -> advantages), so
instead of Slime's barrier at rollout completion, each group enters a FIFO the moment it materialises, and the
earliest U groups go to the trainer as soon as U are there ("once the FIFO accumulates U trainable groups, the
earliest U are dispatched to the trainer"): the trainer starts at t_first^(U) instead of t_complete (Eq. 2).
The FIFO is in materialisation order. When the rest of a round is fewer than U groups (R not a multiple of U, or
groups dropped), they go together once nothing else of the round can arrive. Pair with the `every_u` update (one
optimizer step per U groups, weights published only after the round's last group) for RolloutPipe's semantics.
The paper's Feasible Batch Selector (a per-GPU token budget) is the trainer's own micro-batching here.

Invariant kept: batches are whole materialised groups of a single round, each handed over once.
"""
from __future__ import annotations

from dataclasses import dataclass

from config import F
from sched.base import GroupState, Handoff, Views, register


def fifo(v: Views) -> tuple[list[GroupState], bool]:
    """Ready groups of the oldest round that has any, in materialisation order, and whether they are all that
    round will ever yield (every other group of it is closed)."""
    ready = v.ready_groups()
    if not ready:
        return [], False
    r = min(g.round for g in ready)
    mine = sorted((g for g in ready if g.round == r), key=lambda g: (g.materialized_seq, g.group_id))
    rest = any(not (g := v.groups[gid]).closed and not g.materialized for gid in v.round_groups.get(r, []))
    return mine, not rest


@register
class CompleteGroupPipelining(Handoff):
    name = "cgp"

    @dataclass
    class Params:
        groups: int = F(2, ge=1, help="U = B / K: complete groups per logical update")

    def ready(self, v: Views) -> list[int] | None:
        queue, last = fifo(v)
        if len(queue) >= self.p.groups or (queue and last):
            return [g.group_id for g in queue[:self.p.groups]]
        return None

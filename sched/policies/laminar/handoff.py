"""Experience-buffer handoff: Laminar §3.1-§3.2 step 4 and App. A.3."""
from __future__ import annotations

from dataclasses import dataclass

from config import F
from sched.base import Handoff, register
from sched.decisions import Abort
from sched.views import GroupState, Views


def buffer_order(groups: list[GroupState], order: str) -> list[GroupState]:
    if order == "oldest":
        return sorted(groups, key=lambda g: (g.version, g.materialized_seq, g.group_id))
    return sorted(groups, key=lambda g: (g.materialized_seq, g.group_id))


@register
class ExperienceBuffer(Handoff):
    """The trainer samples completed trajectories from the experience buffer "in parallel with generation" (the
    default sampler is FIFO). Generation never waits for the trainer and the trainer never waits for a round: a
    materialised group enters the buffer the moment its last reward arrives, whichever engine, round or weight
    version produced it, and as soon as the buffer holds `groups` (B) of them the trainer takes a batch of
    exactly B. Two orders:
        fifo     materialisation order (the paper's FIFO sampler)
        oldest   generating version first (min per-token version), then materialisation order
    Pair with `step_publish` (one optimizer step and one publication per batch, §3.2 step 5). Groups left over at
    the end of a run (fewer than B) are never trained; the dispatch's `max_backlog` is the back-pressure.

    Capacity and eviction (§3.1: "eviction strategy for removing old experiences when buffer capacity is not
    enough"; the paper gives neither a capacity nor the strategy it ran): with `capacity` C > 0, whenever more than
    C materialised groups wait, the excess is evicted, whole groups, their samples dropped and counted (Abort,
    requeue=False), never trained. Which ones:
        oldest   the oldest generating version first, then materialisation order (our reading of "old
                 experiences" for off-policy RL: the stalest samples go first)
        fifo     materialisation order (the longest waiting first)
    C = 0 (default) is unbounded, as the paper's throughput runs are; C must be at least B.

    Invariant kept: batches are whole materialised groups, each handed over once, exactly B per batch; at most C
    materialised groups wait after every decision; an evicted group is never trained."""
    name = "experience_buffer"
    paper = "Laminar §3.1-3.2 step 4, App. A.3"

    @dataclass
    class Params:
        groups: int = F(0, ge=0, help="B: groups per training batch (0: the run's prompts_per_step)")
        order: str = F("fifo", choices=("fifo", "oldest"), help="which B groups: materialisation order, or the "
                                                                 "oldest generating version first")
        capacity: int = F(0, ge=0, help="most materialised groups waiting (0: unbounded); the excess is evicted")
        evict: str = F("oldest", choices=("oldest", "fifo"), help="which groups an over-full buffer drops: the "
                                                                  "oldest version first, or materialisation order")

    def __init__(self, params: "ExperienceBuffer.Params | None" = None):
        super().__init__(params)
        self.open: dict[int, None] = {}       # groups seen, not yet materialised (insertion ordered)
        self.buf: list[GroupState] = []       # materialised, not yet handed over
        self.last_round = -1                  # rounds up to this one are in `open` / `buf`
        self.seen = -1                        # Views.materialized at the last scan
        self.consumed = -1                    # TrainerView.groups_consumed when `buf` was last filtered

    def refresh(self, v: Views) -> None:
        """Fold new rounds and new materialisations in: O(groups in generation) per call, not O(all groups)."""
        for r in range(self.last_round + 1, v.round + 1):
            self.open.update(dict.fromkeys(v.round_groups.get(r, ())))
        self.last_round = v.round
        if v.trainer.groups_consumed != self.consumed:   # a group leaves the views only after it was consumed
            self.consumed = v.trainer.groups_consumed
            self.buf = [g for g in self.buf if not g.consumed and v.groups.get(g.group_id) is g]
        if v.materialized == self.seen:
            return
        self.seen = v.materialized
        for gid in list(self.open):
            g = v.groups.get(gid)
            if g is None or g.void or g.consumed:
                del self.open[gid]
            elif g.materialized:
                del self.open[gid]
                self.buf.append(g)

    def evict(self, v: Views) -> list[Abort]:
        cap = self.p.capacity
        if not cap:
            return []
        if cap < (b := self.p.groups or v.prompts_per_step):
            raise ValueError(f"handoff.capacity = {cap} is less than a training batch of {b} groups: the trainer "
                             f"would never get one (set capacity >= {b}, or 0 for unbounded)")
        self.refresh(v)
        if len(self.buf) <= cap:
            return []
        victims = buffer_order(self.buf, self.p.evict)[:len(self.buf) - cap]
        gone = {g.group_id for g in victims}
        self.buf = [g for g in self.buf if g.group_id not in gone]
        return [Abort(-1, [rid for g in victims for rid in g.req_ids])]   # the controller routes by request

    def ready(self, v: Views) -> list[int] | None:
        self.refresh(v)
        b = self.p.groups or v.prompts_per_step
        if len(self.buf) < b:
            return None
        return [g.group_id for g in buffer_order(self.buf, self.p.order)[:b]]

    def batch_groups(self, prompts_per_step: int) -> int | None:
        return self.p.groups or prompts_per_step

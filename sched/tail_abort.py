"""Tail batching, the aborts: RollPacker §3 "race-to-completion" (the rebalance half; `tail_batching` composes
the rounds and owns the long-prompt queue).

In a speculative round (a `RoundPlan` with keep_groups = P0, keep_per_group = R0):
- a group is kept once R0 of its responses have finished, if it is among the first P0 groups to get there
  (ordered by the finish of their R0-th response); its other responses are aborted: "each prompt produces more
  than R0 responses, finishing after the first R0 complete";
- once P0 groups are kept, every response of every other group is aborted, finished ones included ("retains
  only the first P0 that finish"): those groups become void and `tail_batching` queues their prompts for a long
  round, where they run again from scratch.
Aborts drop (requeue=False): the controller counts every aborted response dropped and settles races (a response
that finishes before its abort lands is discarded), so exactly P0 x R0 trajectories of the round reach the trainer
(RollPacker's within-group length bias from eta_r > 1 is thus visible in the dropped counts). Non-speculative
rounds (long rounds, or any other preset's) are never touched.

Invariant kept: a kept group's R0 trajectories and the set of kept groups never change once chosen (both ordered
by finish order, which only grows), so no trained trajectory is ever aborted.
"""
from __future__ import annotations

from sched.base import Abort, Rebalance, Views, register

ABORTABLE = ("pending", "running", "finished")


@register
class TailAbort(Rebalance):
    name = "tail_abort"

    def __init__(self, params=None):
        super().__init__(params)
        self.settled: set[int] = set()      # speculative rounds with every decision made

    def plan(self, v: Views) -> list[Abort]:
        out: list[Abort] = []
        for r, plan in v.plans.items():
            if plan.speculative and r not in self.settled and r in v.round_groups:
                out += self.round_aborts(v, r, plan.keep_groups or len(v.round_groups[r]),
                                         plan.keep_per_group or int(v.params["group_size"]))
        self.settled &= set(v.plans)
        return out

    def round_aborts(self, v: Views, r: int, keep_groups: int, keep_per_group: int) -> list[Abort]:
        firsts: dict[int, set[int]] = {}    # group -> its first keep_per_group finishers
        reached = []
        for gid in v.round_groups[r]:
            fin = sorted((v.requests[i].finished_seq, i) for i in v.groups[gid].req_ids
                         if v.requests[i].finished_seq >= 0)
            if len(fin) >= keep_per_group:
                reached.append((fin[keep_per_group - 1][0], gid))
                firsts[gid] = {i for _, i in fin[:keep_per_group]}
        kept = {gid for _, gid in sorted(reached)[:keep_groups]}
        full = len(kept) == keep_groups
        victims: dict[int, list[int]] = {}
        for gid in v.round_groups[r]:
            if gid not in kept and not full:
                continue                    # still racing
            keep = firsts[gid] if gid in kept else set()
            for i in v.groups[gid].req_ids:
                if i not in keep and v.requests[i].state in ABORTABLE:
                    victims.setdefault(v.requests[i].engine, []).append(i)
        if full:
            self.settled.add(r)             # every later finish is of an aborted request: nothing left to decide
        return [Abort(e, ids) for e, ids in sorted(victims.items())]

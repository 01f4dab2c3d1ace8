"""RollPacker's tail batching (configs/sched/rollpacker.toml; §3): long-tail responses leave rollout GPUs idle,
so prompts are reordered into two kinds of round.

    tail_batching  dispatch   round composition: speculative short rounds and a long-prompt queue
    tail_abort     rebalance  "race-to-completion": the aborts of a speculative round

- short round (speculative): launch ceil(eta_p * P0) fresh prompts with ceil(eta_r * R0) responses each, "while
  accepting only the first P0 x R0 completions": a prompt is kept once R0 of its responses finish (the rest are
  aborted) and the round is closed once P0 prompts are kept; every other prompt is aborted whole and "deferred into
  a long-prompt queue";
- long round: "once the queue accumulates P0 such prompts", they run together, P0 x R0, "without speculative
  execution" (to full length), regenerated from scratch under the current weights.
P0 = the run's prompts_per_step, R0 = its group_size: every round still trains P0 x R0 samples in one synchronous
step. With eta_p = 1.25 the queue fills every 1 / (eta_p - 1) = 4 short rounds (Fig. 4: 4 short + 1 long).

How the halves compose: `tail_batching` returns a `RoundPlan` (kind "short" with keep_groups = P0 and
keep_per_group = R0, or kind "long"); the controller records it in `Views.plans`; `tail_abort` reads the plan and
issues the aborts; the prompts it voided are collected by `tail_batching` from the views into its long queue.
The preset streams finished groups to the trainer and steps once per round with StreamRL's `stream` handoff and
update (sched/policies/streamrl/; RollPacker §4.4's stream trainer). The adaptive reward timeout of §4.3 is a
reward-side mechanism: rl/reward_timeout.py.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from config import F
from sched.base import Abort, Dispatch, Rebalance, RoundPlan, Submit, inner_dispatch, register
from sched.controller import PromptItem
from sched.views import RequestState, Views

S = RequestState


def ceil_mul(eta: float, n: int) -> int:
    return math.ceil(eta * n - 1e-9)


@register
class TailBatching(Dispatch):
    """Round composition; which waiting request goes to which engine is delegated to any registered dispatch
    module (`admit`, default "fifo"; "frontier" gives FGD inside tail-batching rounds).

    Invariant kept: rounds stay synchronous (the base intake: a new round only after the last one is closed and
    every engine holds the trainer's weights), so tail batching only reorders prompts between rounds; no prompt is
    lost."""
    name = "tail_batching"
    paper = "RollPacker §3 (tail batching: speculative short rounds, long-prompt queue)"

    @dataclass
    class Params:
        eta_prompts: float = F(1.25, ge=1, help="prompts launched per short round / P0")
        eta_responses: float = F(1.25, ge=1, help="responses launched per prompt in a short round / R0")
        admit: str = F("fifo", help="the dispatch module that places requests on engines")
        admit_params: dict[str, Any] = F({}, help="that module's parameters")

    def __init__(self, params: "TailBatching.Params | None" = None):
        super().__init__(params)
        self.inner = inner_dispatch(self, self.p.admit, self.p.admit_params)
        self.long_queue: list[Any] = []     # PromptItems of deferred prompts, oldest first
        self.harvested: set[int] = set()    # void group ids already queued
        self.seen_drops = -1                # Views.dropped at the last harvest (a group turns void only on a drop)

    def intake(self, v: Views) -> int | RoundPlan:
        self.harvest(v)
        p0 = super().intake(v)
        if not p0:
            return 0
        r0 = v.group_size
        if len(self.long_queue) >= p0:
            prompts, self.long_queue = self.long_queue[:p0], self.long_queue[p0:]
            return RoundPlan(prompts=prompts, group_size=r0, kind="long")
        return RoundPlan(fresh=ceil_mul(self.p.eta_prompts, p0), group_size=ceil_mul(self.p.eta_responses, r0),
                         kind="short", keep_groups=p0, keep_per_group=r0)

    def harvest(self, v: Views) -> None:
        """Queue the prompts of short-round groups that ended void (deferred by the aborts)."""
        if v.dropped == self.seen_drops:
            return
        self.seen_drops = v.dropped
        for r, plan in v.plans.items():
            if plan.kind != "short":
                continue
            for gid in v.round_groups.get(r, []):
                g = v.groups[gid]
                if g.void and gid not in self.harvested:
                    self.harvested.add(gid)
                    self.long_queue.append(g.prompt)
        self.harvested &= set(v.groups)

    def admit(self, v: Views) -> list[Submit]:
        return self.inner.admit(v)

    def state_dict(self) -> dict[str, Any]:
        return {"long_queue": [asdict(p) for p in self.long_queue], "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.long_queue = [PromptItem(**p) for p in state.get("long_queue", [])]
        self.inner.load_state_dict(state.get("inner", {}))


ABORTABLE = (S.PENDING, S.RUNNING, S.FINISHED)


@register
class TailAbort(Rebalance):
    """In a speculative round (a `RoundPlan` with keep_groups = P0, keep_per_group = R0):
    - a group is kept once R0 of its responses have finished, if it is among the first P0 groups to get there
      (ordered by the finish of their R0-th response); its other responses are aborted: "each prompt produces more
      than R0 responses, finishing after the first R0 complete";
    - once P0 groups are kept, every response of every other group is aborted, finished ones included ("retains
      only the first P0 that finish"): those groups become void and `tail_batching` queues their prompts.
    Aborts drop (requeue=False): the controller counts every aborted response dropped and settles races, so exactly
    P0 x R0 trajectories of the round reach the trainer. Non-speculative rounds are never touched.

    Invariant kept: a kept group's R0 trajectories and the set of kept groups never change once chosen (both
    ordered by finish order, which only grows), so no trained trajectory is ever aborted."""
    name = "tail_abort"
    paper = "RollPacker §3 (race-to-completion aborts)"

    def __init__(self, params: Any = None):
        super().__init__(params)
        self.races: dict[int, _Race] = {}   # speculative round -> its race so far (rebuilt from the views if absent)

    def plan(self, v: Views) -> list[Abort]:
        out: list[Abort] = []
        for r, plan in v.plans.items():
            if not plan.speculative or r not in v.round_groups:
                continue
            race = self.races.get(r)
            if race is None:
                race = self.races[r] = _Race.start(v, r, plan.keep_groups or len(v.round_groups[r]),
                                                   plan.keep_per_group or v.group_size)
            if not race.settled:
                out += race.aborts(v)
        self.races = {r: x for r, x in self.races.items() if r in v.plans}
        return out


@dataclass
class _Race:
    """One speculative round's race to completion, kept incrementally from the round's finish order
    (`Views.round_finishes`): each group's first `per_group` finishers, and the groups in the order they got there."""
    round: int
    keep: int
    per_group: int
    cursor: int = 0                               # finishes of the round read so far
    firsts: dict[int, list[int]] = field(default_factory=dict)   # group -> its first finishers (up to per_group)
    kept: list[int] = field(default_factory=list)  # groups kept, in the order their per_group-th response finished
    todo: list[int] = field(default_factory=list)  # kept groups whose extra responses are not yet aborted
    settled: bool = False                          # P0 groups kept and everything else aborted

    @classmethod
    def start(cls, v: Views, r: int, keep: int, per_group: int) -> "_Race":
        """The race as the views have it now (the requests' finish order), then followed incrementally."""
        race = cls(r, keep, per_group, cursor=len(v.round_finishes(r)))
        done = sorted((q.finished_seq, i) for g in v.round_groups[r] for i in v.groups[g].req_ids
                      if (q := v.requests[i]).finished_seq >= 0)
        for _, i in done:
            race.finished(v.requests[i].group_id, i)
        return race

    def finished(self, gid: int, rid: int) -> None:
        f = self.firsts.setdefault(gid, [])
        if len(f) < self.per_group:
            f.append(rid)
            if len(f) == self.per_group and len(self.kept) < self.keep:
                self.kept.append(gid)
                self.todo.append(gid)

    def aborts(self, v: Views) -> list[Abort]:
        new = v.round_finishes(self.round)[self.cursor:]
        self.cursor += len(new)
        for i in new:
            self.finished(v.requests[i].group_id, i)
        full = len(self.kept) == self.keep
        groups = v.round_groups[self.round] if full else self.todo
        kept = set(self.kept)
        victims: dict[int, list[int]] = {}
        for gid in groups:
            keep = set(self.firsts[gid]) if gid in kept else set()
            for i in v.groups[gid].req_ids:
                if i not in keep and v.requests[i].state in ABORTABLE:
                    victims.setdefault(v.requests[i].engine, []).append(i)
        self.todo = []
        self.settled = full   # every later finish is of an aborted request: nothing left to decide
        return [Abort(e, ids) for e, ids in sorted(victims.items())]

"""RollPacker's rebalance: §3's race-to-completion aborts (`tail_abort`), and with them §4.4's elastic stream
trainer (`rollpacker`: the aborts plus the scale-down of stream_trainer.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from config import F
from sched.base import Rebalance, register
from sched.decisions import Abort, LendEngines, Migrate, Reshard, ReturnEngines
from sched.policies.rollpacker.planner import PlannerParams, TPPlanner
from sched.policies.rollpacker.stream_trainer import ScaleDown, ScaleDownParams
from sched.views import ABORTABLE, Views


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


@register
class RollPackerRebalance(Rebalance):
    """RollPacker's running-trajectory control: the race-to-completion aborts of speculative rounds (`tail_abort`,
    §3), the stream trainer's elastic scale-down (§4.4, Algorithm 1; stream_trainer.ScaleDown): half the
    rollout engines lent to the trainer once 20-50% of a round's responses are done and the projected KV demand
    fits the rest, back at the round's end; and the parallelism planner (§4.2, planner.TPPlanner): the engines' TP
    doubled on a rise in preemptions, halved after steps without any, between steps. `scale_down = false` /
    `planner = false` leave them out. Both act only on a backend that can (the simulator).

    Invariants kept: tail_abort's, ScaleDown's (an engine is lent only empty of running work; at least one engine
    stays in rollout; every lent engine is back before the next round starts) and TPPlanner's (a reshard happens
    only with nothing in flight)."""
    name = "rollpacker"
    paper = "RollPacker §3 (race-to-completion aborts), §4.2 (parallelism planner), §4.4 (stream trainer scale-down)"

    @dataclass
    class Params:
        scale_down: bool = F(True, help="lend rollout engines to the trainer mid-round (§4.4)")
        first: float = F(0.2, ge=0, le=1, help="first milestone: share of the round's responses done")
        last: float = F(0.5, ge=0, le=1, help="last milestone")
        step: float = F(0.05, gt=0, le=1, help="more responses done since the last attempt before another")
        fraction: float = F(0.5, gt=0, lt=1, help="share of the rollout engines lent")
        kv_tokens: int = F(0, ge=0, help="each engine's KV pool in tokens (0: read the engines' counters)")
        planner: bool = F(True, help="adapt the engines' TP to preemptions between steps (§4.2)")
        rise: float = F(1.05, gt=1, help="planner: preemptions above rise x the last step of the same kind: TP x 2")
        zero_steps: int = F(4, ge=1, help="planner: steps without a preemption before TP / 2")
        max_tp: int = F(8, ge=1, help="planner: the largest TP (one GPU server)")

    def __init__(self, params: "RollPackerRebalance.Params | None" = None):
        super().__init__(params)
        if self.p.first > self.p.last:
            raise ValueError(f"sched.rebalance rollpacker: first = {self.p.first} > last = {self.p.last}")
        self.aborts = TailAbort()
        self.scale = ScaleDown(ScaleDownParams(self.p.first, self.p.last, self.p.step, self.p.fraction,
                                               self.p.kv_tokens))
        self.planner = TPPlanner(PlannerParams(self.p.rise, self.p.zero_steps, self.p.max_tp))

    def plan(self, v: Views) -> list[Abort | Migrate | LendEngines | ReturnEngines | Reshard]:
        out: list[Any] = self.aborts.plan(v)
        if self.p.scale_down:
            out += self.scale.plan(v)
        if self.p.planner and not out:
            out += self.planner.plan(v)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale.state_dict(), "planner": self.planner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale.load_state_dict(state.get("scale", {}))
        self.planner.load_state_dict(state.get("planner", {}))

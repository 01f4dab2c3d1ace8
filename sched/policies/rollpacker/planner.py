"""RollPacker's parallelism planner (§4.2): the rollout engines' TP size, adapted step by step to KV preemptions."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sched.decisions import Reshard
from sched.views import RequestState, Views

S = RequestState


@dataclass
class PlannerParams:
    rise: float = 1.05           # a step's preemptions above rise x the reference: TP doubles
    zero_steps: int = 4          # this many consecutive steps without a preemption: TP halves
    max_tp: int = 8              # "TP groups are constrained within a single GPU server"


class TPPlanner:
    """§4.2: "a sudden rise in preemptions (e.g., >1.05x) triggers an increase in TP (doubling the size), while
    sustained zero preemptions across four steps trigger a decrease (halving the size). To limit cross-node
    communication, TP groups are constrained within a single GPU server." The starting TP is the backend's (the
    paper's offline-profiled default). A step's preemptions: those of the responses its round finished (reported
    with each trajectory_finished; responses aborted before they finished are not counted). The reference for a
    "rise" is the previous step of the same round kind (our reading: the paper does not say, and short rounds have up
    to 1.79x the preemptions of long ones, so the previous step would fire at every long -> short switch). The new TP
    is applied between steps (`Reshard`): once the round's rollout is over and trained, the trainer idle, nothing in
    flight, waiting, lent or loading, and only to a size the backend can reshard to (`Views.tp_sizes`: the model
    fits, the size divides the rollout GPUs); otherwise TP stays.

    Invariant kept: never touches a request; the resharded engines adopt the latest weights before they take work."""

    def __init__(self, params: PlannerParams | None = None):
        self.p = params or PlannerParams()
        self.cursor: dict[int, int] = {}          # round -> its finishes read so far
        self.count: dict[int, int] = {}           # round -> preemptions of its finished responses
        self.kind: dict[int, str] = {}            # round -> its kind
        self.prev: dict[str, int] = {}            # round kind -> the preemptions of its last step
        self.zero = 0                             # consecutive steps without a preemption
        self.steps = 0                            # steps decided on
        self.history: list[tuple[int, str, int, int]] = []   # (round, kind, preemptions, TP chosen)

    def plan(self, v: Views) -> list[Reshard]:
        for r in v.round_groups:
            fin = v.round_finishes(r)
            i = self.cursor.get(r, 0)
            if i < len(fin):
                self.count[r] = self.count.get(r, 0) + sum(v.requests[q].preemptions for q in fin[i:]
                                                           if q in v.requests)
                self.cursor[r] = len(fin)
            self.kind.setdefault(r, v.plans[r].kind if r in v.plans else "normal")
        if v.trainer.steps_done <= self.steps or not self._between_steps(v):
            return []
        self.steps = v.trainer.steps_done
        done = [r for r in self.kind if r not in v.round_groups or v.round_done(r)]
        if not done:
            return []
        r = max(done)
        n, kind = self.count.get(r, 0), self.kind[r]
        for x in [x for x in self.kind if x <= r]:  # decided on: forget
            self.kind.pop(x), self.count.pop(x, None), self.cursor.pop(x, None)
        tp = v.tp
        ref = self.prev.get(kind)
        if ref is not None and n > self.p.rise * ref:
            tp, self.zero = 2 * v.tp, 0
        elif n == 0:
            self.zero += 1
            if self.zero >= self.p.zero_steps:
                tp, self.zero = v.tp // 2, 0
        else:
            self.zero = 0
        self.prev[kind] = n
        if tp not in v.tp_sizes or tp > self.p.max_tp or not v.elastic:
            tp = v.tp
        self.history.append((r, kind, n, tp))
        return [Reshard(tp)] if tp != v.tp else []

    @staticmethod
    def _between_steps(v: Views) -> bool:
        return (not v.trainer.busy and v.trainer.published >= v.trainer.version and not v.in_flight()
                and not v.requests.count(S.PENDING) and not any(e.lent or e.loading for e in v.engines))

    def state_dict(self) -> dict[str, Any]:
        return {"prev": dict(self.prev), "zero": self.zero}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prev, self.zero = dict(state.get("prev", {})), int(state.get("zero", 0))

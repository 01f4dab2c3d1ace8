"""Tail batching: RollPacker §3's round composition (speculative short rounds, the long-prompt queue)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from config import F
from sched.base import Dispatch, register
from sched.build import inner_dispatch
from sched.controller import PromptItem
from sched.decisions import RoundPlan, Submit
from sched.views import Views


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

"""Tail batching, round composition: RollPacker §3 (the dispatch half; `tail_abort` is the rebalance half).

Long-tail responses leave rollout GPUs idle, so RollPacker reorders prompts into two kinds of round (§1, §3):
- short round (speculative): launch ceil(eta_p * P0) fresh prompts with ceil(eta_r * R0) responses each, "while
  accepting only the first P0 x R0 completions": a prompt is kept once R0 of its responses finish (the rest are
  aborted) and the round is closed once P0 prompts are kept; every other prompt is aborted whole and "deferred
  into a long-prompt queue";
- long round: "once the queue accumulates P0 such prompts", they run together, P0 x R0, "without speculative
  execution" (to full length), regenerated from scratch under the current weights.
P0 = the run's prompts_per_step, R0 = its group_size: every round still trains P0 x R0 samples in one synchronous
step. With eta_p = 1.25 the queue fills every 1 / (eta_p - 1) = 4 short rounds (Fig. 4: 4 short + 1 long).

How the halves compose: this module returns a `RoundPlan` (kind "short" with keep_groups = P0 and
keep_per_group = R0, or kind "long"); the controller records it in `Views.plans`; `tail_abort` reads the plan and
issues the aborts; the prompts it voided (every sample dropped) are collected here from the views into the long
queue, which this module owns (and checkpoints). Which waiting request goes to which engine is delegated to any
registered dispatch module (`admit`, default "fifo"; "frontier" gives FGD inside tail-batching rounds).

Invariant kept: rounds stay synchronous (the base intake: a new round only after the last one is closed and every
engine holds the trainer's weights), so tail batching only reorders prompts between rounds; no prompt is lost.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

from config import F
from sched.base import REGISTRY, Dispatch, RoundPlan, Submit, Views, register


def ceil_mul(eta: float, n: int) -> int:
    return math.ceil(eta * n - 1e-9)


@register
class TailBatching(Dispatch):
    name = "tail_batching"

    @dataclass
    class Params:
        eta_prompts: float = F(1.25, ge=1, help="prompts launched per short round / P0")
        eta_responses: float = F(1.25, ge=1, help="responses launched per prompt in a short round / R0")
        admit: str = F("fifo", help="the dispatch module that places requests on engines")
        admit_params: dict[str, Any] = F({}, help="that module's parameters")

    def __init__(self, params: "TailBatching.Params | None" = None):
        super().__init__(params)
        if self.p.admit not in REGISTRY["dispatch"] or self.p.admit == self.name:
            raise ValueError(f"tail_batching: admit = {self.p.admit!r} is not a registered dispatch module; "
                             f"available: {sorted(set(REGISTRY['dispatch']) - {self.name})}")
        cls = REGISTRY["dispatch"][self.p.admit]
        try:
            self.inner = cls(cls.Params(**self.p.admit_params))
        except TypeError as e:
            raise ValueError(f"tail_batching: admit_params {self.p.admit_params} for {self.p.admit!r}: {e}") from None
        self.long_queue: list[Any] = []     # PromptItems of deferred prompts, oldest first
        self.harvested: set[int] = set()    # void group ids already queued

    def intake(self, v: Views) -> int | RoundPlan:
        self.harvest(v)
        p0 = super().intake(v)
        if not p0:
            return 0
        r0 = int(v.params["group_size"])
        if len(self.long_queue) >= p0:
            prompts, self.long_queue = self.long_queue[:p0], self.long_queue[p0:]
            return RoundPlan(prompts=prompts, group_size=r0, kind="long")
        return RoundPlan(fresh=ceil_mul(self.p.eta_prompts, p0), group_size=ceil_mul(self.p.eta_responses, r0),
                         kind="short", keep_groups=p0, keep_per_group=r0)

    def harvest(self, v: Views) -> None:
        """Queue the prompts of short-round groups that ended void (deferred by the aborts)."""
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
        return {"long_queue": [asdict(p) if is_dataclass(p) else dict(p) for p in self.long_queue],
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.long_queue = list(state.get("long_queue", []))  # dicts: RoundPlan.prompts accepts them
        self.inner.load_state_dict(state.get("inner", {}))

"""k-step-off rounds: the one-step off-policy pipeline (VeRL-Pipeline / Luo et al., StreamRL §4.1 "strawman 2"),
StreamRL's asynchronous mode (§4.1 "fully asynchronous pipelining", with `admit = "skewness"`), and the rounds of
partial rollout (Kimi / AReaL, with `overlap = true`).

Round n (n = 0, 1, ...) is generated with weights of version >= n - k (`lag` = k): while the trainer trains on round
n - 1, the engines already generate round n with the weights from before that step, so generation of step n + 1
overlaps training of step n and the trainer consumes samples exactly k versions old at most. Rounds start only on a
global sync: every engine holds the latest published version and none is loading (paired with the `barrier` or
`pull_latest` weight sync, which load idle engines). With `overlap = false` a round also waits until the previous
one is generated and scored (every group materialised or void): one round in generation at a time, as in VeRL's
one-step pipeline and StreamRL-Async, where the weight transfer of step n overlaps the trainer's step n + 1. With
`overlap = true` rounds start as soon as the lag allows (up to k + 1 rounds in generation), which is what partial
rollout needs: its rebalance (sched/partial_rollout.py) interrupts whatever is running at a publication and the
engines resume it under the new version.

Which engine gets which request is delegated to any registered dispatch module (`admit`, default "fifo"; StreamRL
uses "skewness"), except that nothing is admitted while an engine lags the latest published version (so a resumed
partial trajectory always continues under the newest weights, and a round's groups start on one version).

Invariant kept (overlap = false, one optimizer step per round): every sample is consumed at most k versions after
the version that generated it; `staleness_bound()` declares k and the controller enforces it at hand-off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import REGISTRY, Dispatch, Submit, Views, register


@register
class OneStepOff(Dispatch):
    name = "one_step"

    @dataclass
    class Params:
        lag: int = F(1, ge=0, help="k: round n starts on weights of version >= n - k (0: synchronous)")
        overlap: bool = F(False, help="start a round as soon as the lag allows, without waiting for the previous "
                                      "round's generation (partial rollout)")
        admit: str = F("fifo", help="the dispatch module that places requests on engines")
        admit_params: dict[str, Any] = F({}, help="that module's parameters")

    def __init__(self, params: "OneStepOff.Params | None" = None):
        super().__init__(params)
        if self.p.admit not in REGISTRY["dispatch"] or self.p.admit == self.name:
            raise ValueError(f"one_step: admit = {self.p.admit!r} is not a registered dispatch module; "
                             f"available: {sorted(set(REGISTRY['dispatch']) - {self.name})}")
        cls = REGISTRY["dispatch"][self.p.admit]
        try:
            self.inner = cls(cls.Params(**self.p.admit_params))
        except TypeError as e:
            raise ValueError(f"one_step: admit_params {self.p.admit_params} for {self.p.admit!r}: {e}") from None

    @staticmethod
    def synced(v: Views) -> bool:
        latest = v.trainer.published
        return latest >= 0 and all(e.version >= latest and not e.loading for e in v.engines)

    def intake(self, v: Views) -> int:
        if not self.synced(v) or v.trainer.published < v.round + 1 - self.p.lag:
            return 0
        if not self.p.overlap and v.round >= 0 and not v.round_done(v.round):
            return 0
        return int(v.params["prompts_per_step"])

    def admit(self, v: Views) -> list[Submit]:
        if not self.synced(v):
            return []
        return self.inner.admit(v)

    def staleness_bound(self) -> int | None:
        return None if self.p.overlap else self.p.lag

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))

"""k-step-off rounds (configs/sched/one_step.toml): the one-step off-policy pipeline (VeRL-Pipeline / Luo et al.,
StreamRL §4.1 "strawman 2"; Laminar's "one-step staleness" baseline).

    one_step      dispatch  round n starts on weights of version >= n - k
    oldest_round  handoff   the oldest untrained round, whole, once it is materialised

The same dispatch runs StreamRL's asynchronous mode (§4.1 "fully asynchronous pipelining", streamrl_async.toml:
`admit = "skewness"`) and the rounds of partial rollout (partial_rollout.toml: `overlap = true`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import Dispatch, Handoff, register
from sched.build import inner_dispatch
from sched.decisions import Submit
from sched.views import Views


@register
class OneStepOff(Dispatch):
    """Round n (n = 0, 1, ...) is generated with weights of version >= n - k (`lag` = k): while the trainer trains
    on round n - 1, the engines already generate round n with the weights from before that step, so generation of
    step n + 1 overlaps training of step n. Rounds start only on a global sync: every engine holds the latest
    published version and none is loading (pair with the `barrier` or `pull_latest` weight sync). With
    `overlap = false` a round also waits until the previous one is generated and scored: one round in generation
    at a time, as in VeRL's one-step pipeline and StreamRL-Async. With `overlap = true` rounds start as soon as the
    lag allows (up to k + 1 rounds in generation), which partial rollout needs. Placement is delegated to any
    registered dispatch module (`admit`, default "fifo"). With `overlap`, nothing is admitted while an engine lags the
    latest published version (a resumed partial trajectory always continues under the newest weights); without,
    the round's remaining requests (a dispatch may hold some back, e.g. StreamRL's small long-tail batches) are
    admitted under the version the round started on, which the `barrier` weight sync keeps on every engine until
    none is left waiting.

    Invariant kept (overlap = false, one optimizer step per round): every sample is consumed at most k versions
    after the version that generated it; `staleness_bound()` declares k and the controller enforces it."""
    name = "one_step"
    paper = "VeRL-Pipeline one-step off-policy; StreamRL §4.1 strawman 2 and asynchronous mode"

    @dataclass
    class Params:
        lag: int = F(1, ge=0, help="k: round n starts on weights of version >= n - k (0: synchronous)")
        overlap: bool = F(False, help="start a round as soon as the lag allows, without waiting for the previous "
                                      "round's generation (partial rollout)")
        admit: str = F("fifo", help="the dispatch module that places requests on engines")
        admit_params: dict[str, Any] = F({}, help="that module's parameters")

    def __init__(self, params: "OneStepOff.Params | None" = None):
        super().__init__(params)
        self.inner = inner_dispatch(self, self.p.admit, self.p.admit_params)

    @staticmethod
    def synced(v: Views) -> bool:
        latest = v.trainer.published
        return latest >= 0 and all(e.version >= latest and not e.loading for e in v.engines)

    def intake(self, v: Views) -> int:
        if not self.synced(v) or v.trainer.published < v.round + 1 - self.p.lag:
            return 0
        if not self.p.overlap and v.round >= 0 and not v.round_done(v.round):
            return 0
        return v.prompts_per_step

    def admit(self, v: Views) -> list[Submit]:
        if self.p.overlap and not self.synced(v):
            return []
        return self.inner.admit(v)

    def staleness_bound(self) -> int | None:
        return None if self.p.overlap else self.p.lag

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state.get("inner", {}))


@register
class OldestRound(Handoff):
    """With k-step-off rounds a later round is already generating while an earlier one waits for the trainer, so
    "the current round" is the wrong one: the trainer gets the OLDEST round that is not yet trained, whole, once
    every group of it is materialised (or void), and never a group of a newer round before it. One batch per
    round; with `step_publish`, one optimizer step and one publication per round.

    Invariant kept: a batch is exactly one round's materialised groups, rounds are trained in order, each once."""
    name = "oldest_round"
    paper = "VeRL-Pipeline one-step off-policy; StreamRL §4.1 strawman 2"

    def ready(self, v: Views) -> list[int] | None:
        for r in sorted(v.round_groups):
            gids = v.round_groups[r]
            if all(v.groups[g].closed for g in gids):
                continue
            if not v.round_done(r):
                return None
            return [g for g in gids if v.groups[g].materialized and not v.groups[g].consumed] or None
        return None

    def batch_groups(self, prompts_per_step: int) -> int | None:
        return prompts_per_step

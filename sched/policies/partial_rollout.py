"""Partial rollout (configs/sched/partial_rollout.toml): Kimi k1.5's "partial rollouts" and AReaL's interruptible
generation; Laminar §2.3 and Fig. 3(d) describe it as the baseline "interrupting generation to load new weights".

    partial_rollout  rebalance  interrupt every running trajectory of an engine older than the latest publication

The preset pairs it with k-step-off rounds that overlap (sched/policies/one_step.py, `overlap = true`), whose
admission waits until every engine holds the latest version, Laminar's `pull_latest` weight sync and its
experience-buffer handoff (sched/policies/laminar/).
"""
from __future__ import annotations

from typing import Any

from sched.base import Rebalance, register
from sched.decisions import Interrupt
from sched.views import RequestState, Views


@register
class PartialRollout(Rebalance):
    """Whenever the trainer publishes a new version, every trajectory still running on an engine that holds an
    older version is interrupted; its tokens so far, their behaviour log-probs and per-token versions come back
    (`Request.partial`), the engine, now empty, loads the new version, and dispatch resubmits the partial requests,
    which re-prefill prompt + response so far (the re-prefill Laminar measures at 24.1% of rollout time) and carry
    on under the new weights. Trajectories therefore mix versions (each token records its own; the trainer's ratio
    uses the recorded log-probs, rl/loss.py).

    Invariant kept: only running trajectories on engines older than the latest published version are interrupted,
    each at most once per publication; nothing is dropped (an interrupted request is pending again, with its
    tokens)."""
    name = "partial_rollout"
    paper = "Kimi k1.5 partial rollouts; AReaL; Laminar §2.3, Fig. 3(d)"

    def __init__(self, params: Any = None):
        super().__init__(params)
        self.seen = 0            # latest publication already acted on
        self.interrupts = 0

    def plan(self, v: Views) -> list[Interrupt]:
        latest = v.trainer.published
        if latest <= self.seen:
            return []
        self.seen = latest
        stale = {e.engine for e in v.engines if e.version < latest}
        by_engine: dict[int, list[int]] = {}
        for r in sorted(v.requests.in_state(RequestState.RUNNING), key=lambda r: r.req_id):
            if r.engine in stale:
                by_engine.setdefault(r.engine, []).append(r.req_id)
        self.interrupts += sum(len(ids) for ids in by_engine.values())
        return [Interrupt(e, ids) for e, ids in sorted(by_engine.items())]

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = int(state.get("seen", 0))

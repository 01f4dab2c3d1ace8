"""StaleFlow hand-off: Consume (§4.2) — the trainer at version w takes buffer V_buf = w, and only once it is
Ready (every entry an occupied, i.e. generated and rewarded, group). Before deciding, the protocol is brought up
to date from the views: groups that materialised are Occupied (after the reward of all members, §4.3), with the
movement step.

Pair with an update that steps and publishes once per batch (`step_publish`): buffer w trains w -> w + 1, so the
trainer's version and the next buffer stay in step (checked).

Invariant kept: consumed buffers are Ready, in version order, each group in them has V + eta >= w, so every
trained trajectory has staleness <= eta (the controller re-checks it at hand-off).
"""
from __future__ import annotations

from dataclasses import dataclass

from config import F
from sched.base import Handoff, Views, register
from sched.staleflow_state import Member, fold


@register
class StaleFlowHandoff(Member, Handoff):
    name = "staleflow"

    @dataclass
    class Params:
        eta: int = F(3, ge=0, help="staleness bound (the same eta as the other StaleFlow tables)")

    def ready(self, v: Views) -> list[int] | None:
        st = self.state(v)
        fold(v, st)
        sb = st.buffers
        if sb.v_next != v.trainer.version:
            raise ValueError(f"staleflow handoff: the trainer is at version {v.trainer.version} but the next buffer "
                             f"is {sb.v_next}; use an update that steps once per batch (step_publish)")
        return sb.consume() if sb.ready() else None

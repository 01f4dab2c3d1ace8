"""StaleFlow's hand-off: Consume (§4.2), the trainer's side of the staleness manager, reading the design's state
(state.py). Outside Algorithm 1: the controller asks it after the round's routes and migrations, as any hand-off.

Invariant kept: consumed buffers are Ready, in version order, each group in them has V + eta >= w.
"""
from __future__ import annotations

from sched.base import Handoff, Preset, register
from sched.decisions import Abort
from sched.policies.staleflow.state import design_state
from sched.views import Views


@register
class StaleFlowHandoff(Handoff):
    """The trainer at version w takes buffer V_buf = w, and only once it is Ready (every entry an occupied, i.e.
    generated and rewarded, group). Before deciding, the protocol is brought up to date from the views: groups that
    materialised are Occupied (after the reward of all members, §4.3), with the movement step. Pair with an update
    that steps and publishes once per batch (`step_publish`): buffer w trains w -> w + 1, so the trainer's version
    and the next buffer stay in step (checked).

    The staleness manager's Aborts (redundancy and filtering, aborts.py) go out from here (`evict`), after the
    buffers are brought up to date.

    Invariant kept: consumed buffers are Ready, in version order, each group in them has V + eta >= w, so every
    trained trajectory has staleness <= eta (the controller re-checks it at hand-off)."""
    name = "staleflow"
    paper = "StaleFlow §4.2 (Consume)"

    def bind(self, preset: Preset) -> None:
        self.state = design_state(preset, f"the {self.name!r} handoff")

    def evict(self, v: Views) -> list[Abort]:
        st = self.state
        if not st.aborts.on:
            return []
        st.sync_buffers(v)
        return st.aborts.plan(v, st.buffers(v))

    def ready(self, v: Views) -> list[int] | None:
        st = self.state
        st.sync_buffers(v)
        sb = st.buffers(v)
        if sb.v_next != v.trainer.version:
            raise ValueError(f"staleflow handoff: the trainer is at version {v.trainer.version} but the next buffer "
                             f"is {sb.v_next}; use an update that steps once per batch (step_publish)")
        return sb.consume() if sb.next_ready() else None

    def batch_groups(self, prompts_per_step: int) -> int | None:
        return prompts_per_step   # a buffer holds `prompts_per_step` entries (state.py)

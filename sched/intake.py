"""Intake shared by the continuous-admission dispatches (areal, lag_cap, pacing, adaptive_concurrency)."""
from __future__ import annotations

from sched.views import Views


class OneBatchAhead:
    """A dispatch's intake for continuous admission: pull a batch (`prompts_per_step` prompts) whenever fewer than a
    batch of pulled prompts wait to be admitted, so one batch always waits. The dispatch counts `pulled` (here) and
    `admitted` (in its admit), both cumulative; mixed in before `Dispatch`."""
    pulled: int = 0
    admitted: int = 0

    def intake(self, v: Views) -> int:
        B = v.prompts_per_step
        if self.pulled - self.admitted >= B:
            return 0
        self.pulled += B
        return B

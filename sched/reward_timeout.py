"""Adaptive reward timeout: RollPacker §4.3 (reward scheduler), for the asynchronous per-sample reward scorer.

A fixed 30 s sandbox timeout per test case let ~5% of code prompts stretch the reward stage to nearly 22% of the
step (Fig. 4b). RollPacker anchors each test case's timeout on how long *correct* solutions of it took so far:

    anchor(tc)  = max execution time of correct responses on tc seen during training
    timeout(tc) = min(max(min_s, scale * anchor(tc)), max_s)          (scale 1.5, min_s 2 s, max_s 30 s)
    a run past timeout(tc) is killed and scores 0 ("terminated early and a zero reward is assigned")

A test case with no correct run yet gets max_s. Keyed by any hashable test-case id. Pure bookkeeping with no
clock of its own: the scorer measures, asks `timeout_s` before a run and reports with `observe` after it. It is
not one of the five mechanism kinds, so it is not registered; the reward scorer owns one per task and checkpoints
its `state_dict`.

Invariant kept: a timeout never goes below a correct run already observed times `scale` (unless capped by
max_s), so a solution as fast as a known-correct one is never cut off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable


class AdaptiveTimeout:
    @dataclass
    class Params:
        scale: float = 1.5       # lambda: headroom over the slowest correct run
        min_s: float = 2.0
        max_s: float = 30.0      # also the timeout of a test case never solved yet

        def __post_init__(self):
            if not (0 < self.min_s <= self.max_s and self.scale >= 1):
                raise ValueError(f"adaptive timeout: need 0 < min_s <= max_s and scale >= 1 "
                                 f"(got min_s={self.min_s}, max_s={self.max_s}, scale={self.scale})")

    def __init__(self, params: "AdaptiveTimeout.Params | None" = None):
        self.p = params if params is not None else self.Params()
        self.anchor: dict[Hashable, float] = {}

    def timeout_s(self, case: Hashable) -> float:
        a = self.anchor.get(case)
        return self.p.max_s if a is None else min(max(self.p.min_s, self.p.scale * a), self.p.max_s)

    def observe(self, case: Hashable, exec_s: float, correct: bool) -> None:
        if correct:
            self.anchor[case] = max(self.anchor.get(case, 0.0), float(exec_s))

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": dict(self.anchor)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.anchor = dict(state.get("anchor", {}))

"""Adaptive reward timeout: RollPacker §4.3 (reward scheduler), for the asynchronous per-sample reward scorer.

A fixed 30 s sandbox timeout per test case let ~5% of code prompts stretch the reward stage to nearly 22% of the
step (Fig. 4b). RollPacker anchors each test case's timeout on how long *correct* solutions of it took so far:

    anchor(tc)  = max execution time of correct responses on tc seen during training
    timeout(tc) = min(max(min_s, scale * anchor(tc)), max_s)          (scale 1.5, min_s 2 s, max_s 30 s)
    a run past timeout(tc) is killed and scores 0 ("terminated early and a zero reward is assigned")

A test case with no correct run yet gets max_s (the paper's rule), or, with `fallback_quantile` set, the same
formula over a running quantile of the latest `window` correct run times of ALL test cases once `min_obs` are in
(our extension, not the paper's: an unseen test case is as hard as a typical solved one, so it need not wait 30 s).
Keyed by any hashable test-case id (the runtime and the simulator key by prompt: one verifier check per prompt).
Pure bookkeeping with no clock of its own: the scorer measures, asks `timeout_s` before a run and reports with
`observe` after it (runtime: `runtime.reward_scorer.AsyncRewardScorer`; simulator: `sim.backend.SimBackend`'s
`reward_timeout`). A reward-side mechanism, not a scheduling one: it lives with the rewards.

Invariant kept: a timeout never goes below a correct run already observed times `scale` (unless capped by
max_s), so a solution as fast as a known-correct one is never cut off.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Hashable


class AdaptiveTimeout:
    @dataclass
    class Params:
        scale: float = 1.5       # lambda: headroom over the slowest correct run
        min_s: float = 2.0
        max_s: float = 30.0      # also the timeout of a test case never solved yet (without the fallback)
        fallback_quantile: float | None = None   # e.g. 0.95: unseen cases get scale x this quantile of all cases
        window: int = 256        # correct run times the running quantile is taken over (the latest ones)
        min_obs: int = 8         # correct runs needed before the quantile is trusted

        def __post_init__(self):
            if not (0 < self.min_s <= self.max_s and self.scale >= 1):
                raise ValueError(f"adaptive timeout: need 0 < min_s <= max_s and scale >= 1 "
                                 f"(got min_s={self.min_s}, max_s={self.max_s}, scale={self.scale})")
            q = self.fallback_quantile
            if (q is not None and not 0 < q <= 1) or self.window < 1 or not 1 <= self.min_obs <= self.window:
                raise ValueError(f"adaptive timeout: need 0 < fallback_quantile <= 1 and 1 <= min_obs <= window "
                                 f"(got {q}, {self.min_obs}, {self.window})")

    def __init__(self, params: "AdaptiveTimeout.Params | None" = None):
        self.p = params if params is not None else self.Params()
        self.anchor: dict[Hashable, float] = {}
        self.recent: deque[float] = deque(maxlen=self.p.window)   # latest correct run times, all cases

    def timeout_s(self, case: Hashable) -> float:
        a = self.anchor.get(case)
        if a is None:
            a = self.typical()
        return self.p.max_s if a is None else min(max(self.p.min_s, self.p.scale * a), self.p.max_s)

    def typical(self) -> float | None:
        """The running `fallback_quantile` of recent correct run times (None: off, or too few yet)."""
        q = self.p.fallback_quantile
        if q is None or len(self.recent) < self.p.min_obs:
            return None
        xs = sorted(self.recent)
        return xs[max(0, math.ceil(q * len(xs) - 1e-9) - 1)]          # nearest-rank quantile

    def observe(self, case: Hashable, exec_s: float, correct: bool) -> None:
        if correct:
            self.anchor[case] = max(self.anchor.get(case, 0.0), float(exec_s))
            self.recent.append(float(exec_s))

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": dict(self.anchor), "recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.anchor = dict(state.get("anchor", {}))
        self.recent = deque(state.get("recent", []), maxlen=self.p.window)

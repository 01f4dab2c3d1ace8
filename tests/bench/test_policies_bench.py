"""bench/policies.py's reward column: the reward reached on the last quarter of the samples trained."""
from __future__ import annotations

import math

from bench.policies import reward_reached
from sched.events import Event


def calls(*pairs: tuple[int, float]) -> list[Event]:
    out = [Event("train_started", 0.0, data={"groups": []})]
    for i, (n, r) in enumerate(pairs):
        out.append(Event("train_step_done", float(i), data={"samples": float(n), "reward_mean": r}))
    return out


def test_the_last_quarter_of_the_samples_weighted_by_each_calls_samples():
    # 256 samples in all: the last quarter (64) is the last call alone under sync-sized calls ...
    assert reward_reached(calls((64, 0.1), (64, 0.2), (64, 0.3), (64, 0.9))) == 0.9
    # ... and the last four 16-sample calls under every-U calls: the same samples, the same answer's weighting
    small = [(16, 0.1)] * 12 + [(16, 0.5), (16, 0.7), (16, 0.9), (16, 0.3)]
    assert math.isclose(reward_reached(calls(*small)), (0.5 + 0.7 + 0.9 + 0.3) / 4)
    # calls of unequal size: whole calls from the end until they hold the quarter, weighted by samples
    assert math.isclose(reward_reached(calls((100, 0.0), (40, 0.2), (10, 0.8))), (40 * 0.2 + 10 * 0.8) / 50)
    assert math.isnan(reward_reached([]))

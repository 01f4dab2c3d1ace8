"""Pacing instead of dropping: tinker-cookbook's async RL staleness control (configs/sched/pacing.toml).

    pacing  dispatch  admission paused while one more group could push any started, untrained group past K
                      versions of staleness; nothing is ever dropped
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import Dispatch, register
from sched.decisions import Submit
from sched.intake import OneBatchAhead
from sched.views import S, Views, least_loaded


@register
class Pacing(OneBatchAhead, Dispatch):
    """Hold staleness at most K by pausing admission rather than discarding stale samples (tinker-cookbook PR #822,
    `tinker_cookbook/rl/train.py`: "A sample generated with the sampler version from iteration s may be trained at
    iteration t only if t - s <= max_steps_off_policy"; dropping stale samples biases the batch toward short prompts,
    which finish before they go stale). The PR's `pipeline_depth` D is how far sampling may run ahead of training
    (the typical staleness under a fast sampler; its default min(1, K)).

    Our derivation of the pause (the PR gives no formula we could read): the trainer takes exactly `batch` (B)
    groups per optimizer step, so at trainer version w it has trained C = w x B groups. A started, untrained group
    g of version u_g is trained at version <= u_g + K as long as fewer than (u_g + K + 1) x B groups other than it
    are ever started before it is trained, i.e. as long as

        groups started so far (cumulative) <= (u_min + K + 1) x B      u_min: oldest version among started,
                                                                       untrained groups (and the one starting)

    holds at every admission: training removes B groups and raises w by one on both sides; only an admission can
    break it. A group therefore starts on an engine at version u only while started < (min(u_min, u) + K + 1) x B
    and, for the depth, started < (u + D + 1) x B. A straggler keeps u_min low and so pauses admission; the trainer
    then runs out of other groups and takes the straggler within K, never discarding it. Every group the cap
    allows goes, whole, to the ready engine with the fewest requests at once (no concurrency cap). Pair it with a
    hand-off of exactly B groups per batch in any order (`experience_buffer`, no capacity) and `step_publish`.

    Invariant kept: no group is ever dropped; with such a hand-off, every sample is trained at most K versions
    after the version it started on (its oldest token's), which the controller checks (`staleness_bound`)."""
    name = "pacing"
    paper = "tinker-cookbook PR #822: enforce staleness by pacing sampling instead of discarding rollouts"

    @dataclass
    class Params:
        max_steps_off_policy: int = F(1, ge=0, help="K: a sample started at version s is trained at version t only "
                                                    "if t - s <= K (tinker-cookbook's max_steps_off_policy)")
        pipeline_depth: int = F(-1, ge=-1, help="D: versions sampling may run ahead of training (tinker-cookbook "
                                                "PR #822's pipeline_depth; -1: its default min(1, K))")

    def __init__(self, params: "Pacing.Params | None" = None):
        super().__init__(params)
        self.admitted = 0                 # groups started, cumulative
        self.pulled = 0                   # groups pulled into the pipeline, cumulative
        self.live: dict[int, int] = {}    # started, untrained group -> the version it started on
        self.paused = 0                   # decisions where the staleness rule (not the depth) paused admission

    @property
    def depth(self) -> int:
        K = self.p.max_steps_off_policy
        return min(1, K) if self.p.pipeline_depth < 0 else self.p.pipeline_depth

    def staleness_bound(self) -> int | None:
        return self.p.max_steps_off_policy

    def admit(self, v: Views) -> list[Submit]:
        B, K = v.prompts_per_step, self.p.max_steps_off_policy
        ready = [e for e in v.engines if e.version >= 0 and not e.loading and not e.lent]
        if not ready or not v.requests.count(S.PENDING):
            return []
        for gid in [gid for gid in self.live if (g := v.groups.get(gid)) is None or g.closed]:
            del self.live[gid]
        oldest = min(self.live.values(), default=None)
        load = {e.engine: e.assigned for e in ready}
        out: dict[int, list[int]] = {}
        for gid, ids in v.pending_by_group().items():
            ahead = [e for e in ready if self.admitted < (e.version + self.depth + 1) * B]
            ok = {e.engine: load[e.engine] for e in ahead
                  if self.admitted < ((e.version if oldest is None else min(oldest, e.version)) + K + 1) * B}
            if not ok:
                self.paused += bool(ahead)        # the depth allowed it; the staleness rule paused it
                break
            eng = least_loaded(ok)
            out.setdefault(eng, []).extend(ids)
            load[eng] += len(ids)
            self.admitted += 1
            self.live[gid] = v.engines[eng].version
            oldest = self.live[gid] if oldest is None else min(oldest, self.live[gid])
        return [Submit(e, ids) for e, ids in sorted(out.items())]

    def stats(self) -> dict[str, float]:
        return {"paused": float(self.paused)}

    def state_dict(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "pulled": self.pulled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.admitted, self.pulled = int(state.get("admitted", 0)), int(state.get("pulled", 0))
        self.live.clear()                 # resumed requests are started again

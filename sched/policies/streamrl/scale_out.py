"""Dynamic scale-out: StreamRL §4.2 "Dynamic adjustment" (Fig. 11)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from config import F
from sched.base import Rebalance, register
from sched.decisions import AddEngines
from sched.policies.streamrl.resource_split import should_scale_out
from sched.views import Views


@register
class ScaleOut(Rebalance):
    """Output lengths grow during training and generation time grows faster than training time, so a split balanced
    at the start drifts generation-bound. After every iteration the gap delta = T_gen - T_train between the two
    stages' measured times is compared with delta' = what one more generation unit (`unit` engines, the paper's
    8-GPU node) would save according to the profile; if delta >= delta', the pool scales out by one unit ("This
    reallocation does not interrupt training"). The profile is P_gen by engine count (`gen_engines`,
    `gen_seconds`: Algorithm 1's generation profile, sim/split.py) scaled to the generation time measured now
    (the paper re-profiles "with the current workload"; we keep its shape: delta' = T_gen x (1 - P(x + unit) /
    P(x)), linear between profiled points). T_gen: a round's start to its last response; T_train: the trainer's
    busy time in the step that just completed. At most one unit per iteration; only on a backend that can
    (`Views.elastic`), within its spare GPUs (`max_engines`: the most engines, 0 = no limit here).

    Invariant kept: never touches running trajectories; the new engines adopt the latest weights before they take
    work (the weight sync's rule)."""
    name = "scale_out"
    paper = "StreamRL §4.2 dynamic adjustment (scale-out when delta >= delta', Fig. 11)"

    @dataclass
    class Params:
        unit: int = F(1, ge=1, help="engines added at a time (the paper adds one 8-GPU node)")
        max_engines: int = F(0, ge=0, help="the most rollout engines (0: no limit besides the backend's)")
        gen_engines: list[int] = F([], help="engine counts of the generation profile (ascending)")
        gen_seconds: list[float] = F([], help="P_gen at those engine counts, seconds per round")

    def __init__(self, params: "ScaleOut.Params | None" = None):
        super().__init__(params)
        if len(self.p.gen_engines) != len(self.p.gen_seconds) or self.p.gen_engines != sorted(self.p.gen_engines):
            raise ValueError("sched.rebalance scale_out: gen_engines (ascending) and gen_seconds must pair up")
        self.start: dict[int, float] = {}        # round -> when it started (first seen)
        self.size: dict[int, int] = {}           # round -> its requests (a round's groups are created together)
        self.gen: dict[int, float] = {}          # round -> its generation time, once generated
        self.busy_since: float | None = None
        self.busy = 0.0                          # trainer busy time since the last step
        self.steps = 0
        self.events: list[tuple[int, float, float]] = []   # (step, delta, delta') of every decision to scale out

    def profile(self, engines: float) -> float:
        xs, ys = self.p.gen_engines, self.p.gen_seconds
        i = bisect.bisect_left(xs, engines)
        if i == 0:
            return ys[0]
        if i == len(xs):
            return ys[-1]
        a, b = xs[i - 1], xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (engines - a) / (b - a)

    def plan(self, v: Views) -> list[AddEngines]:
        if v.round >= 0:
            self.start.setdefault(v.round, v.now)
        for r, gids in v.round_groups.items():
            if r in self.gen:
                continue
            if r not in self.size:
                self.size[r] = sum(v.groups[g].size for g in gids)
            if len(v.round_finishes(r)) >= self.size[r]:
                self.gen[r] = v.now - self.start.get(r, v.now)
        if v.trainer.busy and self.busy_since is None:
            self.busy_since = v.now
        elif not v.trainer.busy and self.busy_since is not None:
            self.busy += v.now - self.busy_since
            self.busy_since = None
        if v.trainer.steps_done <= self.steps:
            return []
        self.steps, t_train, self.busy = v.trainer.steps_done, self.busy, 0.0
        if not v.elastic or not self.p.gen_engines or not self.gen:
            return []
        t_gen = self.gen[max(self.gen)]
        x = len(v.engines)
        if self.p.max_engines and x + self.p.unit > self.p.max_engines:
            return []
        now = lambda n: t_gen * self.profile(n) / self.profile(x)   # noqa: E731  (the profile at today's level)
        if not should_scale_out(t_gen, t_train, now, x, self.p.unit):
            return []
        self.events.append((self.steps, t_gen - t_train, now(x) - now(x + self.p.unit)))
        return [AddEngines(self.p.unit)]

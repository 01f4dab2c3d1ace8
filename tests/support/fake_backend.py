"""A randomised fake Backend for driving any preset through adversarial event orders, and a recording Controller.

`FakeBackend`: engines finish requests after random delays, in any order, with response lengths drawn per prompt
(a long-tailed difficulty shared by a prompt's samples, plus per-sample noise); rewards arrive later; training,
publishing and weight loads take random time. Aborts race the engine: a request that was about to finish (within
`race_s` of the abort) finishes anyway, as on the real engine; otherwise it stops and is acknowledged with
`trajectory_aborted`. Every trajectory records the version of the weights its engine held at submission.

`RecordingController`: the real Controller, which also records each round's plan, groups and starting trainer
version, and the controller's views right after every admission (for frontier checks), independently of the
policies under test, and checks after every decision that the views are consistent (`Views.check`).
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from rl.types import Trajectory
from sched.controller import Controller, PromptItem
from sched.decisions import Abort, LoadWeights
from sched.events import Event


@dataclass
class TrainRecord:
    version: int                 # trainer version when the call started
    step: bool
    publish: bool
    groups: list                 # rl.types.Group


class FakeBackend:
    def __init__(self, num_engines: int, seed: int, race_s: float = 0.5, max_len: int = 40,
                 batch_window: float | None = None):
        self.num_engines = num_engines
        # batch_window: events within this time of the last one count as arrived with it (has_pending), so the
        # controller applies them together and decides once, as it does over real ranks
        self.batch_window = batch_window
        self.batched = 0  # events delivered as part of a batch
        self.rng = random.Random(seed)
        self.seed, self.race_s, self.max_len = seed, race_s, max_len
        self.t = 0.0
        self.q: list[tuple[float, int, Event]] = []
        self.n = 0
        self.cancelled: set[int] = set()
        self.live: dict[int, tuple[int, int, int]] = {}   # req_id -> (engine, finish event id, reward event id)
        self.engine_version = [-1] * num_engines
        self.engine_load = [0] * num_engines
        self.trainer_version = 0
        self.calls: list[TrainRecord] = []
        self.aborted_races = 0
        self.push(0.0, Event("version_published", 0, version=0))

    def now(self) -> float:
        return self.t

    def push(self, dt: float, ev: Event) -> int:
        self.n += 1
        ev.t = self.t + dt
        heapq.heappush(self.q, (ev.t, self.n, ev))
        return self.n

    def length(self, prompt_index: int) -> int:
        """Long-tailed per-prompt difficulty (same for every sample of a prompt), per-sample noise."""
        d = math.exp(random.Random(self.seed * 7919 + prompt_index).gauss(0.0, 0.8))
        return max(1, min(self.max_len, int(4 * d * math.exp(self.rng.gauss(0.0, 0.4)))))

    def submit(self, engine, reqs, prompts):
        for r in reqs:
            assert r.req_id not in self.live, f"request {r.req_id} submitted while live"
            self.engine_load[engine] += 1
            n = self.length(r.prompt_index)
            v = self.engine_version[engine]
            traj = Trajectory(r.group_id, r.sample_index, prompts[r.group_id].prompt_ids, [5] * n, [-1.0] * n,
                              [v] * n, "stop", reward=float(self.rng.random() < 0.5), prompt_index=r.prompt_index)
            dt = n * (0.2 + self.rng.random())
            fin = self.push(dt, Event("trajectory_finished", 0, engine=engine, req_id=r.req_id, group_id=r.group_id,
                                      version=v, data={"tokens": n}))
            rew = self.push(dt + self.rng.random(), Event("reward_scored", 0, engine=engine, req_id=r.req_id,
                                                         group_id=r.group_id, version=v, payload=traj))
            self.live[r.req_id] = (engine, fin, rew)

    def command(self, cmd):
        if isinstance(cmd, LoadWeights):
            assert self.engine_load[cmd.engine] == 0, "weights loaded under running requests"
            self.engine_version[cmd.engine] = cmd.version
            self.push(self.rng.random(), Event("weights_loaded", 0, engine=cmd.engine, version=cmd.version))
            return
        assert isinstance(cmd, Abort), cmd
        for rid in cmd.req_ids:
            engine, fin, rew = self.live[rid]           # the controller only aborts what runs here
            assert engine == cmd.engine
            t_fin = next(t for t, i, _ in self.q if i == fin)
            if t_fin - self.t < self.race_s:             # finished before the abort arrived
                self.aborted_races += 1
                continue
            self.cancelled |= {fin, rew}
            del self.live[rid]
            self.engine_load[engine] -= 1
            self.push(self.rng.random() * 0.3, Event("trajectory_aborted", 0, engine=engine, req_id=rid,
                                                     data={"requeue": cmd.requeue}))

    def train(self, call, groups):
        self.calls.append(TrainRecord(self.trainer_version, call.step, call.publish, groups))
        if call.step:
            self.trainer_version += 1
        self.push(self.rng.random() * 3, Event("train_step_done", 0, version=self.trainer_version,
                                               data={"stepped": call.step}))
        if call.publish:
            self.push(self.rng.random() * 3 + 3, Event("version_published", 0, version=self.trainer_version))

    def next_event(self) -> Event:
        while True:
            t, i, ev = heapq.heappop(self.q)
            if i not in self.cancelled:
                break
        self.t = t
        if ev.kind == "trajectory_finished":
            self.engine_load[ev.engine] -= 1
        elif ev.kind == "reward_scored":
            self.live.pop(ev.req_id, None)
        return ev

    def has_pending(self) -> bool:
        if self.batch_window is None:
            return False
        while self.q and self.q[0][1] in self.cancelled:
            heapq.heappop(self.q)
        pending = bool(self.q) and self.q[0][0] <= self.t + self.batch_window
        self.batched += pending
        return pending

    def drain(self, ctl: Controller) -> None:
        """Deliver every outstanding event to the controller's views (no more decisions): settles the books."""
        while self.q:
            t, i, ev = heapq.heappop(self.q)
            if i not in self.cancelled:
                self.t = t
                ctl.apply(ev)


@dataclass
class RoundRecord:
    plan: object
    groups: list[int]
    prompt_of: dict[int, int]    # group -> prompt index
    size: int                    # requests per group
    version: int                 # trainer version when the round started
    reqs: dict[int, tuple[int, int]] = field(default_factory=dict)  # req_id -> (group, sample_index)


class RecordingController(Controller):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rounds: dict[int, RoundRecord] = {}
        self.admits: list[tuple[list[int], dict[int, list[str]]]] = []  # (admitted groups, states of live groups)
        self.decided: list[dict[int, list[str]]] = []   # after every decision: the request states of live groups

    def start_round(self, plan):
        super().start_round(plan)
        v, r = self.v, self.v.round
        gids = list(v.round_groups[r])
        self.rounds[r] = RoundRecord(v.plans[r], gids, {g: v.groups[g].prompt_index for g in gids},
                                     v.groups[gids[0]].size if gids else 0, v.trainer.version,
                                     {i: (g, v.requests[i].sample_index) for g in gids for i in v.groups[g].req_ids})

    def decide(self, backend):
        super().decide(backend)
        self.v.check()                       # the views stay consistent whatever the policies decided
        v = self.v
        self.decided.append({g.group_id: [v.requests[i].state for i in g.req_ids] for g in v.open_groups()})

    def submit(self, backend, sub):
        super().submit(backend, sub)
        v = self.v
        states = {g.group_id: [v.requests[i].state for i in g.req_ids] for g in v.groups.values()}
        self.admits.append((sorted({v.requests[i].group_id for i in sub.req_ids}), states))


def source(distinct: int | None = None):
    """Prompts 0, 1, 2, ... (cycling over `distinct` prompts if given, so a per-prompt history can learn)."""
    counter = iter(range(10**9))

    def take(n):
        out = []
        for _ in range(n):
            i = next(counter)
            j = i % distinct if distinct else i
            out.append(PromptItem(j, [1, 2, 3 + j % 5] + [7] * (j % 3), str(j)))
        return out
    return take

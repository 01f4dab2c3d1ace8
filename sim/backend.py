"""SimBackend: the controller's Backend (sched/controller.py) on a virtual clock.

It emits the same events as the runtime (runtime/rollout_worker.py, runtime/train_worker.py), with the same data
fields, so sched.metrics and sched.timeline read a simulated log exactly as a real one:

    engine_busy / engine_idle          decode activity spans per engine
    tokens_decoded                     engine counters (total, running, waiting, kv_used/kv_free in blocks, plus
                                       tokens, preemptions, and per-request progress when enabled; on a
                                       multi-turn workload `tools`: requests waiting on a tool call)
    tool_started                       a multi-turn request's model turn ended in a tool call (data: turn, the model
                                       turn that made it counting from 1, and tool, the workload's tool name)
    tool_finished                      the call returned (data: turn, seconds, failed: it timed out); the
                                       observation is then appended and prefilled (sim/engine.py, "Multi-turn")
    trajectory_finished                data: tokens, finish_reason
    reward_scored                      data: reward, correct, failed, task, latency_s (the call), wait_s (queued for
                                       a scorer); payload: an rl.types.Trajectory whose token
                                       ids / logprobs / versions have the simulated length (versions per token;
                                       a multi-turn one's observation tokens: loss_mask 0, logprob 0.0)
    trajectory_aborted                 data: requeue, tokens (for Abort commands)
    trajectory_interrupted             data: tokens; payload: the partial Trajectory (all tokens so far, per-token
                                       versions); a resubmitted request re-prefills them (sim/engine.py `add`)
    weights_loaded                     after LoadWeights (relay -> engine, cost.load_s)
    train_step_done                    data: stepped, reward_mean, accuracy, response_len_mean/max, truncated_frac,
                                       samples, tokens, step_time_s
    version_published                  after a publishing train call (cost.publish_s), and version 0 at start

Rewards: each finished sample is scored by its prompt's task (sim/cost.py `RewardLatency`: the task is the prompt's,
from its `mix` uniform) after a sampled latency, on a pool of `reward_workers` scorers (0: as many as needed), first
come first served. By default a sample goes to the pool the moment it finishes (asynchronous scoring beside the
engines: our runtime's and RollPacker §4.3's); with `reward_stage=True` a round's samples wait until every request of
the round has left its engine, then go together (veRL's separate, synchronous reward stage). A run killed at its
task's limit, or at the adaptive timeout (`reward_timeout`, RollPacker §4.3, for sandboxed tasks only, keyed by
(prompt, task)), scores 0.

The trainer runs one call at a time, in order, like the runtime's trainer thread: a call starts when the previous
call and its publication are done. With `cost.controller_s_per_trajectory` (a CPU run's controller sharing the train
leader's CPU; disaggregated mode) every trajectory that finishes while a call runs extends that call by it, so a
call's end is known only when it comes (`_TrainRun`; the calls issued meanwhile wait in order). With
`cost.publish_train_share` = a (a CPU run's weight sender on the train ranks' core) an overlapped publication shares
the processor with the call running beside it: while both run the call progresses at 1 - a and the publication at
a (`_Publication`, one at a time), each otherwise alone at full speed.

Migration (an Interrupt with a destination, the controller's Migrate): the trajectory's tokens reach its new engine
as KV over the interconnect at `cost.kv_move_s` when the profile gives a rate (`kv_move_s_per_token`, Laminar's
repack), else they are re-prefilled there like an interrupted trajectory's.

Scale-out (AddEngines, StreamRL §4.2): new engines take GPUs from `spare_gpus`, start without weights, and load
the latest version when the weight sync says. Reshard (RollPacker §4.2's planner): between rounds, every engine is
rebuilt at the new TP on the same GPUs (the cost profile's roofline at that TP, sim/profiles.py `at_tp`), without
weights; stale wake-ups of the old engines are ignored. Elastic pool (LendEngines / ReturnEngines, RollPacker §4.4's
scale-down): a lent engine stops (it is empty: its requests were migrated away) and its GPUs join the trainer for
the calls that start while it is lent. Colocated, a call made while engines are lent runs on their GPUs alone and
pauses no other engine; a call with none lent runs on every GPU and pauses every engine, as before.
`colocated=True` models engines and trainer time-sharing the same GPUs (veRL, our runtime's colocated mode): every
engine stops decoding while the trainer works and publishes.

Engine faults (Laminar §3.3, §8.5: "manually kill a rollout machine containing two replicas"): `faults`, each an
`EngineFault(at_s, engines, down_s)`, kills those engines at `at_s` and brings them back `down_s` later, empty and
without weights, as a replacement machine (math.inf: never; the controller retires them). The engines then stream
their requests' tokens to the controller's partial-response pool every `stream_every_s` of the virtual clock, at
the counters tick (`isolates_faults`; a kill loses what each request generated since), and a kill reports
`engine_failed` with what each request held, as the runtime's rollout worker does; commands that reach a dead
engine before the controller has folded its failure are void there (the runtime's rollout worker voids them until
ResetEngine, a no-op here). The streaming period is an assumption (Laminar §3.3 gives no granularity):
our runtime streams at every counters report, a few engine steps; the
simulator's default, 10 s, keeps a fault run of Laminar's 128-GPU setting within ~2x a fault-free one's CPU time
(at 1 s, 10x: every running request's chunk at every tick), and bounds what a kill loses to ~10 s of decoding per
request (the figure that reads it says so).
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from rl.types import Group, Trajectory
from sched.controller import PromptItem
from sched.decisions import (AddEngines, Abort, Interrupt, LendEngines, LoadWeights, Reshard, ResetEngine,
                             ReturnEngines, TrainCall)
from sched.events import Event
from sched.metrics import rollout_stats
from sched.resources import DecodeProfile
from sched.views import Request
from sim.clock import EventQueue
from sim.cost import CostModel
from sim.engine import SimEngine, SimRequest
from sim.profiles import at_tp, tp_sizes
from sim.tokens import FAKE_LOGPROB, FAKE_TOKEN, RunList, fake_run, trusted_runs
from sim.workload import Workload

_TICK = "counters-tick"           # a queue item: every busy engine reports its counters (SimBackend._tick)


@dataclass
class _TrainRun:
    """A train call whose end is known only when it comes (the controller's CPU stretches it, an overlapped
    publication shares its processor): issued, then running from `start` until start + work + lag."""
    call: TrainCall
    data: dict[str, Any]
    version: int
    work: float           # its seconds alone (the controller's stretches added)
    start: float = math.inf
    lag: float = 0.0      # what sharing the processor with publications has cost it so far
    gen: int = 0          # its end's queue item is current while gen matches (a change pushes a new one)


@dataclass
class _Publication:
    """An overlapped publication on a processor it shares with the train calls (cost.publish_train_share)."""
    version: int
    start: float
    lag: float = 0.0
    gen: int = 0


@dataclass(frozen=True)
class _TrainEnd:
    gen: int


@dataclass(frozen=True)
class _PublishEnd:
    gen: int


_RESHARE = "reshare"              # a queue item: a queued train call starts (SimBackend._reshare)


@dataclass(frozen=True)
class EngineFault:
    """Engines `engines` die at `at_s` of the virtual clock and come back `down_s` later (math.inf: never)."""
    at_s: float
    engines: tuple[int, ...]
    down_s: float


@dataclass(frozen=True)
class _ToolDone:
    """A queue item: request `req`'s tool call on engine `engine` returns (SimBackend._tool_done)."""
    engine: int
    req: SimRequest


@dataclass(frozen=True)
class _Up:
    """A queue item: a failed engine is back (SimBackend._recover)."""
    engine: int
    down_s: float


def loss_mask_runs(calls, done: int) -> tuple[tuple[int, int], ...]:
    """The loss mask of a multi-turn response's first `done` tokens as runs: 1 for model tokens, 0 for the
    observations of `calls` (sim/episodes.py CallSpec)."""
    runs, pos = [], 0
    for c in calls:
        if c.at >= done:
            break
        obs = min(c.obs, done - c.at)
        runs += [(1, c.at - pos), (0, obs)]
        pos = c.at + obs
    runs.append((1, done - pos))
    return tuple((v, n) for v, n in runs if n > 0)


def _runs_of(values) -> list[tuple[int, int]]:
    """Run-length encoding of a plain list of per-token versions."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return [(v, c) for v, c in out]


class SimStalled(RuntimeError):
    """Nothing is in flight but the controller still waits: the policy will never make progress."""


class StopSimulation(Exception):
    """Raised by next_event once `stop_after_samples` trained samples have been reported done (see simulate)."""


class SimBackend:
    elastic = True                    # takes LendEngines / ReturnEngines / AddEngines

    def __init__(self, cost: CostModel, workload: Workload, num_engines: int, train_gpus: int, seed: int = 0, *,
                 colocated: bool = False, counters_every_s: float | None = None, progress: bool = False,
                 max_events: int | None = None, stop_after_samples: int | None = None,
                 reward_timeout: Any = None, reward_workers: int = 0, reward_stage: bool = False,
                 spare_gpus: int = 0, faults: Sequence[EngineFault] = (), stream_every_s: float = 10.0,
                 minibatches: int = 1, proximal_pass: bool = False):
        if num_engines < 1 or train_gpus < 1 or minibatches < 1:
            raise ValueError(f"need at least one engine, one train GPU and one minibatch, got {num_engines}, "
                             f"{train_gpus} and {minibatches}")
        for f in faults:
            if not (f.at_s >= 0 and f.down_s > 0 and f.engines and all(0 <= i < num_engines for i in f.engines)):
                raise ValueError(f"engine fault {f}: needs at_s >= 0, down_s > 0 and engines among "
                                 f"0..{num_engines - 1}")
        if faults and counters_every_s is None:
            raise ValueError("engine faults need counters_every_s: the engines stream their partial trajectories to "
                             "the controller at counters ticks")
        self.isolates_faults = bool(faults)    # the controller keeps the partial-response pool (sched/partials.py)
        self.stream_ticks = 0                  # stream at every this-many-th counters tick (0: never)
        if faults:
            k = stream_every_s / counters_every_s
            if not (k >= 1 and abs(k - round(k)) < 1e-9):
                raise ValueError(f"stream_every_s={stream_every_s:g} must be a whole multiple of counters_every_s="
                                 f"{counters_every_s:g}")
            self.stream_ticks = round(k)
        self.cost, self.workload, self.train_gpus, self.colocated = cost, workload, train_gpus, colocated
        self.minibatches = minibatches         # optimizer steps of a stepping call (trainer/trainer.py train_step)
        self.proximal_pass = proximal_pass     # decoupled PPO: a stepping call of several steps pays cost.proximal_s
        self.q = EventQueue()
        first_rank = 0 if colocated else train_gpus
        self.first_rank, self.counters_every_s, self.progress = first_rank, counters_every_s, progress
        self.engines = [self._engine(i, first_rank + i * cost.gpus_per_engine) for i in range(num_engines)]
        self.spare_gpus = spare_gpus           # GPUs the pool may still scale out onto (AddEngines)
        self.reshards: list[tuple[float, int]] = []   # (when, new TP) of every Reshard
        self.tp_sizes = tp_sizes(cost, num_engines * cost.gpus_per_engine)   # what Reshard may ask for
        self.kv_block_size = cost.block_size   # tokens per block of the engines' kv_used / kv_free counters
        self.replaced: list[SimEngine] = []    # engines a reshard replaced (their counters still count)
        self.rng = random.Random(f"sim-backend:{seed}")
        self.trainer_version = 0
        self.trainer_free = 0.0
        self.publish_free = 0.0       # when the last publication's transfer ends
        self.controller_s = 0.0 if colocated else cost.controller_s_per_trajectory
        self.publish_share = 0.0 if colocated else cost.publish_train_share
        self.train_runs: deque[_TrainRun] = deque()   # with either: the calls issued, the first running
        self.publications: deque[_Publication] = deque()   # with publish_share: overlapped ones, the first sending
        self.shared_since: float | None = None        # when the running call and publication began to share
        self._gens = itertools.count(1)               # end items: current while their gen is their owner's
        self.max_events = max_events
        self.events_out = 0
        self.stop_after_samples = stop_after_samples
        self.reward_timeout = reward_timeout   # an rl.reward_timeout.AdaptiveTimeout (RollPacker §4.3), or None
        self.reward_killed = 0                 # runs cut by the adaptive timeout
        self.reward_workers = [0.0] * reward_workers   # when each scorer is free (a heap; empty: unlimited)
        self.reward_stage = reward_stage
        self.on_engine: dict[int, int] = {}    # round -> its requests on an engine (reward_stage: when to score)
        self.held: dict[int, list[tuple[int, SimRequest]]] = {}   # round -> finished samples awaiting its stage
        self.reward_busy_s = 0.0               # scorer-seconds spent
        self.moving: dict[int, int] = {}       # req_id -> destination of a migration whose KV travels there
        self.lent: set[int] = set()            # engines lent to the trainer
        self.lent_from: dict[int, float] = {}  # when each lent engine's GPUs join the trainer (after cost.switch_s)
        self.switch_s = cost.switch_s          # what the controller's views report (Views.switch_s)
        self.lent_gpu_s = 0.0                  # GPU-seconds of train calls run on lent engines
        self.samples_trained = 0   # samples of train calls whose train_step_done has been delivered
        # Engine counters: every busy engine reports at each tick k x counters_every_s of the virtual clock, all in
        # one batch (`has_pending`), as a coordinator pulling a snapshot from every instance at once would see them
        # (StaleFlow §4.1); a report reads the engine's lazy state and does not end its segment.
        self._burst: deque[Event] = deque()
        self._bursting = False
        self._tick_armed = False
        self.emit(Event("version_published", 0.0, rank=0, version=0))  # engines start from the trainer's weights
        for f in faults:
            self.q.push(f.at_s, f)

    def _engine(self, index: int, rank: int) -> SimEngine:
        return SimEngine(index, rank, self.cost, self, self.counters_every_s, self.progress, self.isolates_faults,
                         self.workload.multi_turn)

    @property
    def decode_profile(self) -> DecodeProfile:
        """The engines' decode step for policies that plan with it (StreamRL's Algorithm 2): the cost model's."""
        c = self.cost
        return DecodeProfile(c.k2, c.k3, c.k1, c.k4, c.kv_capacity_tokens, c.max_num_seqs)

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    @property
    def preemptions(self) -> int:
        return sum(e.preemptions for e in self.replaced + self.engines)

    @property
    def reprefill_s(self) -> float:
        """Engine-seconds spent recomputing KV that a weight load discarded (partial rollout's re-prefill)."""
        return sum(e.reprefill_s for e in self.replaced + self.engines)

    # ------------------------------------------------------------------------------------------ engine host
    def emit(self, ev: Event) -> None:
        if self._bursting:
            self._burst.append(ev)
            return
        self.q.push(ev.t, ev)
        self._arm_tick()

    def wake(self, engine: int, t: float, gen: int) -> None:
        self.q.push(t, (engine, gen))
        self._arm_tick()

    def _arm_tick(self) -> None:
        """Schedule the next counters tick, if none is: on any push, and after a tick that found an engine busy (a
        simulation with nothing left in its queue has none, so a stall is still detected)."""
        if self.counters_every_s is None or self._tick_armed:
            return
        self._tick_armed = True
        period = self.counters_every_s
        self.q.push((math.floor(self.q.now / period + 1e-9) + 1) * period, _TICK)

    def _tick(self, t: float) -> None:
        self._tick_armed = False
        self._bursting = True
        stream = bool(self.stream_ticks) and round(t / self.counters_every_s) % self.stream_ticks == 0
        try:
            for e in self.engines:
                if e.busy:
                    e.counters(t, stream)
        finally:
            self._bursting = False
        if any(e.busy for e in self.engines):
            self._arm_tick()

    def has_pending(self) -> bool:
        """More events of the same batch (a tick's counters) are ready: the controller takes them before deciding."""
        return bool(self._burst)

    @staticmethod
    def trajectory(engine: int, r: SimRequest, reason: str, **kw) -> Trajectory:
        """r's trajectory so far; a multi-turn one's observation tokens have loss mask 0 and logprob 0.0."""
        rr = r.runs      # RunList(r.runs), without its generic checks; mostly one version throughout
        if len(rr) == 1 and rr[0][1] > 0:
            runs, total = ((rr[0][0], rr[0][1]),), rr[0][1]
        else:
            runs = tuple([(v, c) for v, c in rr if c > 0])
            total = sum([c for _, c in runs])
        logprobs = fake_run(FAKE_LOGPROB, r.done)
        if r.calls:
            mask = loss_mask_runs(r.calls, r.done)
            kw["loss_mask"] = trusted_runs(mask, r.done)
            logprobs = trusted_runs(tuple((FAKE_LOGPROB if m else 0.0, n) for m, n in mask), r.done)
        return Trajectory(r.group_id, r.sample_index, r.prompt_ids, fake_run(FAKE_TOKEN, r.done),
                          logprobs, trusted_runs(runs, total), reason,
                          prompt_index=r.prompt_index,
                          meta={"engine": engine, "preemptions": r.preemptions}, **kw)

    def tool_started(self, engine: int, r: SimRequest, t: float) -> None:
        """r's model turn ended in a tool call on `engine` at t: tool_started now, its return queued."""
        e = self.engines[engine]
        call = r.calls[r.turn]
        self.emit(Event("tool_started", t, rank=e.rank, engine=engine, req_id=r.req_id, group_id=r.group_id,
                        version=e.version, data={"turn": r.turn + 1, "tool": self.workload.tool}))
        self.q.push(t + call.seconds, _ToolDone(engine, r))

    def _tool_done(self, item: _ToolDone, t: float) -> None:
        """A tool call returns: its tool_finished, then the observation (unless the request left the engine)."""
        if item.engine >= len(self.engines):
            return
        e, r = self.engines[item.engine], item.req
        if not e.tool_returned(r, t):
            return
        call = r.calls[r.turn]
        self.emit(Event("tool_finished", t, rank=e.rank, engine=e.index, req_id=r.req_id, group_id=r.group_id,
                        version=e.version, data={"turn": r.turn + 1, "seconds": call.seconds,
                                                 "failed": call.failed}))
        e.observe(r)

    def finished(self, engine: int, r: SimRequest, t: float) -> None:
        reason = "length" if r.done >= self.workload.max_len else "stop"
        version = min(r.runs)[0]             # the oldest version of its runs
        self.emit(Event("trajectory_finished", t, rank=self.engines[engine].rank, engine=engine, req_id=r.req_id,
                        group_id=r.group_id, version=version,
                        data={"tokens": r.done, "finish_reason": reason, "preemptions": r.preemptions}))
        if self.controller_s:
            self._stretch(t)
        if self.reward_stage:
            self.held.setdefault(r.round, []).append((engine, r))
        else:
            self.score(engine, r, t)
        self.left_engine(r.round, t)

    def left_engine(self, rnd: int, t: float) -> None:
        """A request of round `rnd` left its engine; with reward_stage, the round's stage starts once none is left."""
        self.on_engine[rnd] -= 1
        if self.reward_stage and self.on_engine[rnd] == 0:
            for engine, r in self.held.pop(rnd, []):
                self.score(engine, r, t)

    def score(self, engine: int, r: SimRequest, t: float) -> None:
        """Queue sample r's reward call at time t on the scorer pool; emit its reward_scored at the call's end."""
        spec = self.workload.prompt(r.prompt_index)
        task = self.cost.reward.task_of(spec.mix)
        latency, killed = task.sample(self.rng, spec.reward_z)
        correct = not killed and self.rng.random() < spec.p_correct
        if self.reward_timeout is not None and task.sandbox and not killed:
            key = (r.prompt_index, task.name)        # the anchor is per (prompt, task): one test case per prompt
            limit = self.reward_timeout.timeout_s(key)
            if latency > limit:
                latency, correct = limit, False
                self.reward_killed += 1
            else:
                self.reward_timeout.observe(key, latency, correct)
        start = t
        if self.reward_workers:
            start = max(t, heapq.heappop(self.reward_workers))
            heapq.heappush(self.reward_workers, start + latency)
        self.reward_busy_s += latency
        reason = "length" if r.done >= self.workload.max_len else "stop"
        traj = self.trajectory(engine, r, reason, reward=float(correct), correct=correct)
        self.emit(Event("reward_scored", start + latency, rank=self.engines[engine].rank, engine=engine,
                        req_id=r.req_id, group_id=r.group_id, version=min(r.runs)[0],
                        data={"reward": float(correct), "correct": correct, "failed": False, "task": task.name,
                              "latency_s": latency, "wait_s": start - t},
                        payload=traj))

    # ---------------------------------------------------------------------------------------- Backend protocol
    def now(self) -> float:
        return self.q.now

    def submit(self, engine: int, reqs: list[Request], prompts: dict[int, PromptItem]) -> None:
        if self.engines[engine].failed:  # sent before the controller knew: it takes them back at engine_failed
            return
        w = self.workload
        sims = []
        for r in reqs:
            ep = w.episode(r.prompt_index, r.sample_index) if w.multi_turn else None
            s = SimRequest(r.req_id, r.group_id, r.sample_index, r.prompt_index, r.prompt_len,
                           ep.length if ep else w.response_len(r.prompt_index, r.sample_index), w.max_len,
                           prompts[r.group_id].prompt_ids, round=r.round, calls=ep.calls if ep else ())
            self.on_engine[r.round] = self.on_engine.get(r.round, 0) + 1
            if r.partial is not None:  # resume: its tokens so far are re-prefilled on admission
                s.done = len(r.partial.response_ids)
                vs = r.partial.versions
                s.runs = [[v, c] for v, c in (vs.runs if isinstance(vs, RunList) else _runs_of(vs))]
                s.preemptions = int(r.partial.meta.get("preemptions", 0))
                s.moved = self.moving.pop(r.req_id, -1) == engine   # a migration: its KV arrives, not recomputed
                s.catch_up()             # the calls whose observations it holds
            s.streamed = s.done          # the pool's entry opens with them
            sims.append(s)
        self.engines[engine].add(sims, self.now())

    @property
    def tp(self) -> int:
        return self.cost.gpus_per_engine

    def command(self, cmd: Abort | Interrupt | LoadWeights | LendEngines | ReturnEngines | AddEngines | Reshard
                | ResetEngine) -> None:
        if isinstance(cmd, ResetEngine) or (isinstance(cmd, LoadWeights) and self.engines[cmd.engine].failed):
            return   # the engine dropped everything when it failed; a load sent before the controller knew is void
        if isinstance(cmd, Reshard):
            if self.lent or any(e.running or e.waiting or e.tools for e in self.engines):
                raise SimStalled(f"Reshard(tp={cmd.tp}) while engines hold requests or are lent")
            gpus = len(self.engines) * self.cost.gpus_per_engine
            self.cost = at_tp(self.cost, cmd.tp)
            gen = max(e.gen for e in self.engines) + 1
            self.replaced += self.engines
            self.engines = [self._engine(i, self.first_rank + i * cmd.tp) for i in range(gpus // cmd.tp)]
            for e in self.engines:
                e.gen = gen                    # the old engines' wake-ups in the queue are stale
            self.reshards.append((self.now(), cmd.tp))
        elif isinstance(cmd, AddEngines):
            need = cmd.count * self.cost.gpus_per_engine
            if need > self.spare_gpus:
                raise SimStalled(f"AddEngines({cmd.count}) needs {need} GPUs; {self.spare_gpus} spare")
            self.spare_gpus -= need
            for _ in range(cmd.count):
                i = len(self.engines)
                self.engines.append(self._engine(i, self.first_rank + i * self.cost.gpus_per_engine))
        elif isinstance(cmd, LendEngines):
            for i in cmd.engines:
                self.engines[i].hold(self.now(), until=math.inf)
                self.lent_from[i] = self.now() + (0.0 if self.colocated else self.cost.switch_s)
            self.lent.update(cmd.engines)
        elif isinstance(cmd, ReturnEngines):
            for i in cmd.engines:
                self.engines[i].release(self.now())
                if self.cost.switch_s and not self.colocated:     # it wakes before it decodes again
                    self.engines[i].hold(self.now(), duration=self.cost.switch_s)
                self.lent_from.pop(i, None)
            self.lent.difference_update(cmd.engines)
        elif isinstance(cmd, LoadWeights):
            self.engines[cmd.engine].hold(self.now(), duration=self.cost.load_s, version=cmd.version,
                                          keep_kv=cmd.keep_kv)
        elif isinstance(cmd, Abort):
            e = self.engines[cmd.engine]
            for r in e.remove(cmd.req_ids, self.now()):
                self.emit(Event("trajectory_aborted", e.t, rank=e.rank, engine=e.index, req_id=r.req_id,
                                group_id=r.group_id, version=min((v for v, _ in r.runs), default=e.version),
                                data={"requeue": bool(cmd.requeue), "tokens": r.done}))
                self.left_engine(r.round, e.t)
            e.schedule_segment()
        elif isinstance(cmd, Interrupt):
            e = self.engines[cmd.engine]
            for r in e.remove(cmd.req_ids, self.now()):
                if cmd.dst >= 0 and self.cost.kv_move_s_per_token:
                    self.moving[r.req_id] = cmd.dst
                self.emit(Event("trajectory_interrupted", e.t, rank=e.rank, engine=e.index, req_id=r.req_id,
                                group_id=r.group_id, version=e.version, data={"tokens": r.done},
                                payload=self.trajectory(e.index, r, "interrupted")))
                self.left_engine(r.round, e.t)
            e.schedule_segment()
        else:  # a Migrate never reaches a backend: the controller sends an Interrupt, then a resubmission
            raise TypeError(f"unknown backend command {type(cmd).__name__}")

    def train(self, call: TrainCall, groups: list[Group]) -> None:
        now = self.now()
        tokens = sum(len(t.prompt_ids) + len(t.response_ids) for g in groups for t in g.trajectories)
        start = max(now, self.trainer_free)
        # a call runs on the lent engines whose switch to the trainer is done when it starts
        lent_gpus = sum(1 for i in self.lent if self.lent_from.get(i, 0.0) <= start) * self.cost.gpus_per_engine
        gpus = lent_gpus if self.colocated and self.lent else self.train_gpus + lent_gpus
        # the trainer's optimizer steps in this call: one per minibatch (at most one per sample) when it steps over
        # groups, the one over accumulated gradients when it steps over none, none when it only accumulates
        samples = sum(len(g.trajectories) for g in groups)
        steps = (min(self.minibatches, samples) if samples else 1) if call.step else 0
        dur = self.cost.train_s(tokens, gpus, steps)
        if self.proximal_pass:
            dur += self.cost.proximal_s(tokens, gpus, steps)
        if self.cost.train_cold_s and now > self.trainer_free and not self.train_runs:   # the trainer idled
            dur += self.cost.train_cold_s
        self.lent_gpu_s += dur * lent_gpus
        done = start + dur
        if call.step:
            self.trainer_version += 1
        data = {"stepped": call.step, **rollout_stats(groups), "tokens": float(tokens)}
        if self.controller_s or self.publish_share:
            self.train_runs.append(_TrainRun(call, data, self.trainer_version, dur))
            if len(self.train_runs) == 1:
                self._start_run(now)
            return
        self.emit(Event("train_step_done", done, rank=0, version=self.trainer_version,
                        data={**data, "step_time_s": dur}))
        self._trained(call, done)
        if self.colocated and not self.lent:
            for e in self.engines:
                e.hold(now, until=self.trainer_free)

    def _start_run(self, now: float) -> None:
        run = self.train_runs[0]
        run.start = max(now, self.trainer_free)
        if run.start > now and self.publications:
            self.q.push(run.start, _RESHARE)   # it begins to share then
        self._reshare(now)

    def _stretch(self, t: float) -> None:
        """A trajectory finished at t: the running call (if one runs) has controller_s more to do."""
        run = self.train_runs[0] if self.train_runs else None
        if run is not None and run.start <= t:
            run.work += self.controller_s
            self._reshare(t)

    def _reshare(self, now: float) -> None:
        self._settle(now)
        self._place(now)

    def _settle(self, now: float) -> None:
        """What sharing the processor cost the running call (run at 1 - a) and the sending publication (run at a)
        since they began to share."""
        if self.shared_since is not None:
            dt, a = now - self.shared_since, self.publish_share
            self.train_runs[0].lag += dt * a
            self.publications[0].lag += dt * (1.0 - a)
            self.shared_since = None

    def _place(self, now: float) -> None:
        """Both ends from now: at the shared rates while a call runs beside a publication, else each alone at full
        speed (without publications a call ends at start + work, lag 0)."""
        run = self.train_runs[0] if self.train_runs and self.train_runs[0].start <= now else None
        pub = self.publications[0] if self.publications else None
        a = self.publish_share
        both = run is not None and pub is not None
        self.shared_since = now if both else None
        if run is not None:
            end = run.start + run.work + run.lag
            run.gen = next(self._gens)
            self.trainer_free = now + (end - now) / (1.0 - a) if both else end
            self.q.push(self.trainer_free, _TrainEnd(run.gen))
        elif self.train_runs and not math.isinf(self.train_runs[0].start):   # issued, starting later
            nxt = self.train_runs[0]
            nxt.gen = next(self._gens)
            self.q.push(nxt.start + nxt.work, _TrainEnd(nxt.gen))
        if pub is not None:
            end = pub.start + self.cost.publish_s + pub.lag
            pub.gen = next(self._gens)
            self.q.push(now + (end - now) / a if both else end, _PublishEnd(pub.gen))

    def _run_ended(self, end: _TrainEnd, t: float) -> None:
        run = self.train_runs[0] if self.train_runs else None
        if run is None or end.gen != run.gen:
            return     # superseded
        self._settle(t)
        self.train_runs.popleft()
        self.emit(Event("train_step_done", t, rank=0, version=run.version,
                        data={**run.data, "step_time_s": run.work + run.lag}))
        self._trained(run.call, t, run.version)
        if self.train_runs:
            self._start_run(t)
        elif self.publications:
            self._place(t)

    def _published(self, end: _PublishEnd, t: float) -> None:
        pub = self.publications[0] if self.publications else None
        if pub is None or end.gen != pub.gen:
            return
        self._settle(t)
        self.publications.popleft()
        self.emit(Event("version_published", t, rank=0, version=pub.version, data={"seconds": t - pub.start}))
        if self.publications:
            self.publications[0].start = t
        self._place(t)

    def _trained(self, call: TrainCall, done: float, version: int | None = None) -> None:
        """The trainer is free at `done`, after the call's publication when it publishes without overlap."""
        version = self.trainer_version if version is None else version
        self.trainer_free = done
        if call.publish and call.overlap_publish and self.publish_share:
            # sent while the next calls train, sharing their processor; one publication at a time
            self.publications.append(_Publication(version, done))
            if len(self.publications) == 1:
                self._place(done)
        elif call.publish:
            # An overlapped publication (call.overlap_publish) is sent while the next call trains: the trainer is
            # free at `done`, the transfers still go out one at a time (runtime/train_worker.py AsyncSender).
            start = max(done, self.publish_free)
            self.publish_free = start + self.cost.publish_s
            if not call.overlap_publish:
                self.trainer_free = self.publish_free
            self.emit(Event("version_published", self.publish_free, rank=0, version=version,
                            data={"seconds": self.cost.publish_s}))

    def _fail(self, f: EngineFault, t: float) -> None:
        for i in f.engines:
            e = self.engines[i]
            if e.failed:
                continue
            held = e.fail(t)
            for r in held:
                self.on_engine[r.round] = self.on_engine.get(r.round, 0) - 1   # resubmitted later: counted again
            self.emit(Event("engine_failed", e.t, rank=e.rank, engine=i, version=e.version,
                            data={"error": f"injected: engines {list(f.engines)} killed at {f.at_s:g} s (simulated)",
                                  "held": {r.req_id: r.done for r in held}, "permanent": math.isinf(f.down_s)}))
            if not math.isinf(f.down_s):
                self.q.push(e.t + f.down_s, _Up(i, f.down_s))

    def _recover(self, up: _Up, t: float) -> None:
        e = self.engines[up.engine]
        e.recover(t)
        self.emit(Event("engine_recovered", e.t, rank=e.rank, engine=e.index, version=e.version,
                        data={"down_s": up.down_s}))

    def run_until(self, t: float) -> list[Event]:
        """Advance the clock to t, returning the events due by then (for tests and tools driving engines directly)."""
        out = []
        while self._burst or (self.q and self.q.peek_time() <= t):
            out.append(self.next_event())
        self.q.now = max(self.q.now, t)
        return out

    def _count(self, ev: Event) -> Event:
        self.events_out += 1
        if self.max_events is not None and self.events_out > self.max_events:
            raise SimStalled(f"more than {self.max_events} events by t={ev.t:.3f} s: is the policy looping?")
        if ev.kind == "train_step_done":
            self.samples_trained += int(ev.data.get("samples", 0))
        return ev

    def next_event(self) -> Event:
        if self.stop_after_samples is not None and self.samples_trained >= self.stop_after_samples:
            raise StopSimulation
        while True:
            if self._burst:
                return self._count(self._burst.popleft())
            if not self.q:
                busy = [e.index for e in self.engines if e.running or e.waiting or e.tools]
                raise SimStalled(f"simulation stalled at t={self.q.now:.3f} s: nothing is in flight (engines with "
                                 f"work: {busy[:8]}, trainer idle) and the controller is still waiting")
            t, item = self.q.pop()
            if isinstance(item, Event):
                return self._count(item)
            if item is _TICK:
                self._tick(t)
                continue
            if isinstance(item, EngineFault):
                self._fail(item, t)
                continue
            if isinstance(item, _Up):
                self._recover(item, t)
                continue
            if isinstance(item, _ToolDone):
                self._tool_done(item, t)
                continue
            if isinstance(item, _TrainEnd):
                self._run_ended(item, t)
                continue
            if isinstance(item, _PublishEnd):
                self._published(item, t)
                continue
            if item is _RESHARE:
                self._reshare(t)
                continue
            engine, gen = item
            if engine < len(self.engines):     # else: a wake-up of an engine gone in a reshard
                self.engines[engine].on_wake(t, gen)

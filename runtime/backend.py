"""RuntimeBackend: the controller's Backend over real ranks (sched/controller.py drives it); it composes every
message the leader sends (runtime/messages.py).

    submit              -> Start on the control channel to the engine's rollout rank (a request with a
                           `partial` trajectory is resumed there); for a partial whose KV another rank kept at its
                           migration (`kv_rank`), a SendKV to that rank first (runtime/kv_transfer.py)
    command             -> the decision itself (Abort, Interrupt, LoadWeights; the lifecycle's ResetEngine) to the
                           engine's rollout rank; the controller turns a Migrate into Interrupt + a later submit, so
                           none arrives here
    train / call        -> work items for the trainer (the leader's trainer thread, runtime/train_worker.py);
                           `call` waits for a SaveCheckpoint / ExportHF to be done
    notify_publication  -> ReceiveWeights to every rollout rank, from the trainer thread right before the broadcast
                           they must join
    next_event          <- events from rollout ranks (lists, one message per engine step) and from the trainer
                           thread, in arrival order; the wait names who is being waited for, and its deadline
                           (runtime/watchdog.py) is renewed by the progress of any rollout rank or the trainer
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

from rl.types import Group
from runtime import watchdog
from runtime.channel import WORKER, Channel
from runtime.messages import (ExportHF, ReceiveWeights, SaveCheckpoint, SendKV, Start, StartRequest, Stop, Train,
                              WorkDone)
from runtime.topology import Topology
from sched.controller import PromptItem
from sched.decisions import Abort, Interrupt, LoadWeights, ResetEngine, TrainCall
from sched.events import Event
from sched.views import Request

LEFT_ENGINE = ("trajectory_finished", "trajectory_aborted", "trajectory_interrupted")  # a request left its engine


class RuntimeBackend:
    def __init__(self, topo: Topology, channel: Channel, t0: float, to_trainer: Callable[[Any], None],
                 isolates_faults: bool = False, kv_block_size: int = 0):
        self.topo, self.channel, self.to_trainer = topo, channel, to_trainer
        self.kv_block_size = kv_block_size       # tokens per block of the engines' kv_used / kv_free counters
        self.isolates_faults = isolates_faults   # the workers report engine_failed (runtime/engine_health.py)
        self.num_engines = len(topo.rollout_ranks)
        # every rank trains and generates: a train call pauses rollout. No `elastic`: the train group is fixed at
        # launch (FSDP2 over the train ranks), so a rollout rank's GPU cannot join the trainer mid-round.
        self.colocated = bool(set(topo.train_ranks) & set(topo.rollout_ranks))
        self.t0 = t0
        self.senders = sorted({0, *topo.rollout_ranks})   # whoever may send the controller an event
        self.pending: collections.deque[Event] = collections.deque()
        self.sent = [0] * self.num_engines   # requests sent to each engine and not back yet (for the deadline message)
        self.training = False
        # a SendKV and its Start, and a publication's notices, go out whole: every rollout rank sees KV transfers and
        # publications in one order, so none waits in the broadcast for a rank that waits for its KV
        self.order = threading.Lock()

    def now(self) -> float:
        return time.time() - self.t0

    # ----------------------------------------------------------------------------------------- to the ranks
    def submit(self, engine: int, reqs: list[Request], prompts: dict[int, PromptItem]) -> None:
        starts = [StartRequest(r.req_id, r.group_id, r.sample_index, r.prompt_index, prompts[r.group_id].prompt_ids,
                               prompts[r.group_id].answer, prompts[r.group_id].max_new_tokens, r.partial)
                  for r in reqs]
        self.sent[engine] += len(reqs)
        dst = self.topo.engine_rank(engine)
        with self.order:
            for r in reqs:
                src = r.partial.meta.get("kv_rank") if r.partial is not None else None
                if src is not None and src != dst:
                    self.channel.send(SendKV(r.req_id, dst), src, WORKER)
            self.channel.send(Start(starts), dst, WORKER)

    def command(self, cmd: Abort | Interrupt | LoadWeights | ResetEngine) -> None:
        if not isinstance(cmd, (Abort, Interrupt, LoadWeights, ResetEngine)):
            raise TypeError(f"unknown backend command {type(cmd).__name__}")
        self.channel.send(cmd, self.topo.engine_rank(cmd.engine), WORKER)

    def notify_publication(self, version: int) -> None:
        with self.order:
            for r in self.topo.rollout_ranks:
                self.channel.send(ReceiveWeights(version), r, WORKER)

    def stop_workers(self) -> None:
        for r in self.topo.rollout_ranks:
            self.channel.send(Stop(), r, WORKER)

    # ------------------------------------------------------------------------------------------ the trainer
    def train(self, call: TrainCall, groups: list[Group]) -> None:
        self.training = True
        self.to_trainer(Train(call, groups))

    def call(self, item: SaveCheckpoint | ExportHF) -> None:
        """Run a checkpoint or an export on the trainer and wait until it is done (events that arrive meanwhile
        are kept for next_event)."""
        work = type(item).__name__
        self.to_trainer(item)
        while True:
            src, msg = self.channel.get(waiting_for=f"the trainer to finish {work}", on=self.senders)
            if isinstance(msg, WorkDone) and msg.work == work:
                if msg.error is not None:
                    raise RuntimeError(f"trainer failed during {work}:\n{msg.error}")
                return
            self._receive(src, msg)
            failed = next((e for e in self.pending if e.kind == "rank_failed"), None)
            if failed is not None:   # the trainer died before it got to this item: it never will
                raise RuntimeError(f"rank {failed.rank} failed: {failed.data.get('error', 'unknown error')}")

    # ---------------------------------------------------------------------------------------------- events
    def next_event(self) -> Event:
        while not self.pending:
            src, msg = self.channel.get(waiting_for=self._waiting_for(), on=self.senders)
            self._receive(src, msg)
        ev = self.pending.popleft()
        watchdog.progress(f"applied {ev.kind}")
        return ev

    def _receive(self, src: int, msg: Any) -> None:
        for ev in (msg if isinstance(msg, list) else [msg]):
            if not isinstance(ev, Event):
                raise RuntimeError(f"rank {src} sent {type(ev).__name__} where an event was expected")
            if ev.kind in LEFT_ENGINE and 0 <= ev.engine < self.num_engines:
                self.sent[ev.engine] = max(self.sent[ev.engine] - 1, 0)
            elif ev.kind == "engine_failed":
                self.sent[ev.engine] = 0
            elif ev.kind == "train_step_done":
                self.training = False
            self.pending.append(ev)

    def has_pending(self) -> bool:
        """Events already received (the rest of an engine step's message, or whole messages that are waiting in
        the inbox): the controller applies them all before deciding once."""
        if not self.pending:
            for src, msg in self.channel.poll():
                self._receive(src, msg)
        return bool(self.pending)

    def _waiting_for(self) -> str:
        busy = [f"engine {i} (rank {self.topo.engine_rank(i)}, {n} requests)" for i, n in enumerate(self.sent)
                if n > 0]
        parts = busy + (["the trainer"] if self.training else [])
        return "events from " + (", ".join(parts) if parts else "anyone (nothing is in flight)")


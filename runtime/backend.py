"""RuntimeBackend: the controller's Backend over real ranks (sched/controller.py drives it).

    submit / command    -> messages on the control channel to the engine's rollout rank (a request with a
                           `partial` is resumed there; Interrupt -> ("interrupt", req_ids); Migrate is the
                           controller's: it arrives here as Interrupt + a later submit)
    train               -> a work item for the trainer thread (runtime/train_worker.py) on this rank
    next_event          <- events from rollout ranks (lists, one message per engine step) and from the trainer
                           thread, in arrival order, with a deadline that names who was being waited for
"""
from __future__ import annotations

import collections
import queue
import time
from typing import Any

from rl.types import Group
from runtime.channel import WORKER, Channel, ChannelTimeout
from runtime.topology import Topology
from sched.base import Abort, Interrupt, LoadWeights, Migrate, TrainCall
from sched.controller import PromptItem
from sched.views import Request
from sched.events import Event


LEFT_ENGINE = ("trajectory_finished", "trajectory_aborted", "trajectory_interrupted")  # a request left its engine


class RuntimeBackend:
    def __init__(self, topo: Topology, channel: Channel, train_queue: "queue.Queue[Any]", t0: float,
                 timeout_s: float):
        self.topo, self.channel, self.train_queue = topo, channel, train_queue
        self.num_engines = len(topo.rollout_ranks)
        self.t0 = t0
        self.timeout_s = timeout_s
        self.pending: collections.deque[Event] = collections.deque()
        self.assigned = [0] * self.num_engines   # for the deadline message only
        self.training = False

    def now(self) -> float:
        return time.time() - self.t0

    def submit(self, engine: int, reqs: list[Request], prompts: dict[int, PromptItem]) -> None:
        specs = [self._spec(r, prompts[r.group_id]) for r in reqs]
        self.assigned[engine] += len(reqs)
        self.channel.send(("submit", specs), self.topo.engine_rank(engine), WORKER)

    @staticmethod
    def _spec(r: Request, prompt: PromptItem) -> dict[str, Any]:
        """What the rollout worker needs to start (or, with r.partial, resume) one request."""
        spec: dict[str, Any] = dict(req_id=r.req_id, group_id=r.group_id, sample_index=r.sample_index,
                                    prompt_index=r.prompt_index, prompt_ids=prompt.prompt_ids, answer=prompt.answer,
                                    max_new_tokens=getattr(prompt, "max_new_tokens", None))
        part = r.partial
        if part is not None:
            spec["partial"] = dict(response_ids=list(part.response_ids), logprobs=list(part.logprobs),
                                   versions=list(part.versions), rng_state=part.meta.get("rng_state"))
        return spec

    def command(self, cmd: Abort | Interrupt | Migrate | LoadWeights) -> None:
        if isinstance(cmd, LoadWeights):
            self.channel.send(("load", cmd.version), self.topo.engine_rank(cmd.engine), WORKER)
        elif isinstance(cmd, Abort):
            self.channel.send(("abort", cmd.req_ids, cmd.requeue), self.topo.engine_rank(cmd.engine), WORKER)
        elif isinstance(cmd, Interrupt):
            self.channel.send(("interrupt", list(cmd.req_ids)), self.topo.engine_rank(cmd.engine), WORKER)
        elif isinstance(cmd, Migrate):
            raise TypeError(f"Migrate({cmd.src} -> {cmd.dst}, {cmd.req_ids}) reached the runtime backend: the "
                            "controller turns a Migrate into Interrupt + resubmit, backends never see one")
        else:
            raise TypeError(f"unknown backend command {type(cmd).__name__}")

    def train(self, call: TrainCall, groups: list[Group]) -> None:
        self.training = True
        self.train_queue.put(("train", call, groups))

    def next_event(self) -> Event:
        while not self.pending:
            src, msg = self.channel.get(timeout=self.timeout_s, waiting_for=self._waiting_for())
            self._receive(src, msg)
        return self.pending.popleft()

    def _receive(self, src: int, msg: Any) -> None:
        for ev in (msg if isinstance(msg, list) else [msg]):
            if not isinstance(ev, Event):
                raise RuntimeError(f"rank {src} sent {type(ev).__name__} where an event was expected")
            if ev.kind in LEFT_ENGINE and 0 <= ev.engine < self.num_engines:
                self.assigned[ev.engine] = max(self.assigned[ev.engine] - 1, 0)
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
        busy = [f"engine {i} (rank {self.topo.engine_rank(i)}, {n} requests)" for i, n in enumerate(self.assigned)
                if n > 0]
        parts = busy + (["the trainer"] if self.training else [])
        return "events from " + (", ".join(parts) if parts else "anyone (nothing is in flight)")


__all__ = ["RuntimeBackend", "ChannelTimeout"]

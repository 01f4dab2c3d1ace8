"""Colocated mode (`cluster.colocate = true`): every rank runs an engine *and* a shard of the FSDP2 trainer, taking
turns on the same device. For one-GPU users (NCCL refuses two ranks on one GPU) and as the baseline the
disaggregated papers compare against.

Each rank's main thread runs a ColocatedWorker: the rollout worker's messages plus the trainer's work items, which
the controller sends to every rank at once ("train", "checkpoint", "export"), so the FSDP2 collectives line up.
After an optimizer step whose call publishes, every rank gathers the full weights inside the train group and
copies them into its engine in place: the engine's version moves with the trainer's, with no broadcast.
Rank 0 also runs the controller, in a second thread, talking to its own worker through the channel's ports.
"""
from __future__ import annotations

import threading
import traceback
from typing import Any

from rl.types import Group
from runtime.backend import RuntimeBackend
from runtime.channel import CONTROLLER, WORKER
from runtime.rollout_worker import RolloutWorker
from runtime.train_worker import _floats
from sched.metrics import rollout_stats
from sched.base import TrainCall
from sched.controller import Controller
from sched.events import Event
from trainer.fsdp import full_tensors
from trainer.trainer import Trainer


class ColocatedWorker(RolloutWorker):
    def __init__(self, *args: Any, trainer: Trainer, **kw: Any):
        super().__init__(*args, **kw)
        self.trainer = trainer

    def sync_engine(self) -> None:
        """Copy the trainer's weights into the engine (collective: every rank gathers its shards' full tensors)."""
        self.engine.load_weights(full_tensors(self.trainer.model), self.trainer.step)
        self.event("weights_loaded", version=self.trainer.step)

    def start(self) -> None:
        self.sync_engine()
        if self.rank == 0:
            self.event("version_published", version=self.trainer.step)
        self.flush()

    def handle(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "train":
            _, call, groups = msg
            metrics = self.trainer.train_step(groups, step=call.step)
            if self.rank == 0:
                self.event("train_step_done", version=self.trainer.step,
                           data={"stepped": call.step, **rollout_stats(groups), **_floats(metrics)})
            if call.publish:
                if self.rank == 0:
                    self.event("version_published", version=self.trainer.step)
                self.sync_engine()
        elif kind == "load":
            if msg[1] != self.engine.version:
                raise RuntimeError(f"rank {self.rank}: colocated engine holds version {self.engine.version}, "
                                   f"told to load {msg[1]}")
            self.event("weights_loaded", version=self.engine.version)
        elif kind == "checkpoint":
            _, ckpt_dir, extra, keep = msg
            self.trainer.save_checkpoint(ckpt_dir, extra=extra, keep_last=keep)
            self._done(kind)
        elif kind == "export":
            self.trainer.export_hf(msg[1])
            self._done(kind)
        else:
            return super().handle(msg)
        return True

    def _done(self, kind: str) -> None:
        if self.rank == 0:
            self.channel.post(("done", kind), CONTROLLER)


class ColocatedBackend(RuntimeBackend):
    """Train calls and trainer work go to every rank's worker; engine i is rank i."""

    def train(self, call: TrainCall, groups: list[Group]) -> None:
        self.training = True
        for r in range(self.topo.world):
            self.channel.send(("train", call, groups), r, WORKER)

    def call(self, item: tuple) -> None:
        """Run a checkpoint/export item on every rank and wait for rank 0's answer; events meanwhile are kept."""
        for r in range(self.topo.world):
            self.channel.send(item, r, WORKER)
        while True:
            _, msg = self.channel.get(timeout=self.timeout_s, waiting_for=f"every rank to finish {item[0]}")
            if msg == ("done", item[0]):
                return
            for ev in (msg if isinstance(msg, list) else [msg]):
                if isinstance(ev, Event) and ev.kind == "rank_failed":
                    raise RuntimeError(f"rank {ev.rank} failed: {ev.data.get('error')}")
                self.pending.append(ev)

    def stop_all(self) -> None:
        for r in range(self.topo.world):
            self.channel.send(("stop",), r, WORKER)


class ControllerThread:
    """Rank 0's controller beside its worker. Errors are kept and re-raised in the main thread."""

    def __init__(self, controller: Controller, backend: ColocatedBackend, finish: Any, after_event: Any = None):
        self.controller, self.backend, self.finish, self.after_event = controller, backend, finish, after_event
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="controller", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.controller.run(self.backend, self.after_event)
            self.finish(self.backend)
        except BaseException:
            self.error = traceback.format_exc()
        finally:
            self.backend.stop_all()

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout=timeout_s)
        if self.error:
            raise RuntimeError(f"controller failed:\n{self.error}")


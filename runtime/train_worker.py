"""The train partition's side of the runtime.

On the train leader (global rank 0) a trainer thread takes work items from the controller's queue; every item is
first broadcast to the other train ranks (followers), then all of them run it together (FSDP2 collectives inside):

    ("train", TrainCall, groups)     train_step on the groups; publish the new weights if the call says so
    ("publish", version)             publish the current weights (at start-up, so engines start from ours)
    ("checkpoint", dir, extra)       torch.distributed.checkpoint save (model, optimizer, schedule, extra)
    ("export", dir)                  HF-layout safetensors export
    None                             stop

The leader thread reports back as events on its own control-channel inbox, so the controller sees training the way
it sees engines: train_step_done (with the step's metrics) and version_published.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist

from runtime.channel import WORKER, Channel
from runtime.topology import Topology
from runtime.watchdog import maybe_kill
from sched.events import Event
from sched.metrics import rollout_stats
from trainer.publish import WeightPublisher
from trainer.trainer import Trainer


class AsyncSender:
    """Runs the sending half of an overlapped publication in the background, one at a time (StreamRL §4.1: the
    weight transfer of step n overlaps the training of step n + 1). A failure is raised at the next `wait`."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: str | None = None

    def submit(self, fn: Callable[[], None]) -> None:
        self.wait()  # publications go out in version order: the rollout ranks receive them in that order
        self.thread = threading.Thread(target=self._run, args=(fn,), name="publisher", daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException:
            self.error = traceback.format_exc()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"overlapped weight publication failed:\n{err}")


def run_item(item: tuple, trainer: Trainer, publisher: WeightPublisher,
             report: Callable[[Event], None] | None = None, notify_engines: Callable[[int], None] | None = None,
             clock: Callable[[], float] = time.time, sender: AsyncSender | None = None) -> None:
    """Run one work item on this train rank (collectively with the other train ranks). With `sender` (the leader)
    a call that asks for `overlap_publish` gathers the weights now and sends them in the background."""
    kind = item[0]
    if kind == "train":
        _, call, groups = item
        metrics = trainer.train_step(groups, step=call.step)
        maybe_kill(trainer.step)  # fault injection (runtime/watchdog.py); a no-op otherwise
        if report:
            report(Event("train_step_done", clock(), rank=0, version=trainer.step,
                         data={"stepped": call.step, **rollout_stats(groups), **_floats(metrics)}))
        if call.publish and call.overlap_publish and sender is not None:
            _publish_overlapped(trainer.step, publisher, report, notify_engines, clock, sender)
        elif call.publish:  # (a follower gathers the same buckets in either case)
            _publish(trainer.step, publisher, report, notify_engines, clock)
    elif kind == "publish":
        _publish(item[1], publisher, report, notify_engines, clock)
    elif kind == "checkpoint":
        _, ckpt_dir, extra, keep = item
        trainer.save_checkpoint(ckpt_dir, extra=extra, keep_last=keep)
    elif kind == "export":
        trainer.export_hf(item[1])
    else:
        raise ValueError(f"unknown trainer work item {kind!r}")


def _publish(version: int, publisher: WeightPublisher, report, notify_engines, clock) -> None:
    if notify_engines:
        notify_engines(version)
    stats = publisher.publish(version)
    if report:
        report(Event("version_published", clock(), rank=0, version=version, data=_floats(stats)))


def _publish_overlapped(version: int, publisher: WeightPublisher, report, notify_engines, clock,
                        sender: AsyncSender) -> None:
    snap = publisher.pack(version)  # collective with the followers; a packed copy of the weights

    def send() -> None:
        if notify_engines:
            notify_engines(version)
        stats = publisher.send(snap)
        if report:
            report(Event("version_published", clock(), rank=0, version=version, data=_floats(stats)))
    sender.submit(send)


def _floats(d: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in d.items() if isinstance(v, (int, float))}


def broadcast_item(item: Any, topo: Topology) -> Any:
    holder = [item]
    dist.broadcast_object_list(holder, src=topo.train_ranks[0], group=topo.work_group or topo.train_group)
    return holder[0]


class TrainerThread:
    """The leader's trainer: runs work items in order, off the controller's thread."""

    def __init__(self, trainer: Trainer, publisher: WeightPublisher, topo: Topology, channel: Channel, t0: float):
        self.trainer, self.publisher, self.topo, self.channel, self.t0 = trainer, publisher, topo, channel, t0
        self.queue: "queue.Queue[Any]" = queue.Queue()
        self.replies: "queue.Queue[str | None]" = queue.Queue()  # for call(): None = done, str = a traceback
        self.done = threading.Event()
        self.sender = AsyncSender()
        self.thread = threading.Thread(target=self._loop, name="trainer", daemon=True)
        self.thread.start()

    def _clock(self) -> float:
        return time.time() - self.t0

    def _notify(self, version: int) -> None:
        for r in self.topo.rollout_ranks:
            self.channel.send(("recv_weights", version), r, WORKER)

    def _loop(self) -> None:
        try:
            while True:
                item = self.queue.get()
                if len(self.topo.train_ranks) > 1:
                    broadcast_item(item, self.topo)
                if item is None:
                    self.sender.wait()
                    return
                run_item(item, self.trainer, self.publisher, self.channel.post, self._notify, self._clock,
                         self.sender)
                if item[0] in ("checkpoint", "export"):
                    self.replies.put(None)
        except BaseException:
            err = traceback.format_exc()
            self.replies.put(err)
            self.channel.post(Event("rank_failed", self._clock(), rank=0, data={"error": err}))
        finally:
            self.done.set()

    def call(self, item: tuple, timeout_s: float) -> None:
        """Run a checkpoint/export item and wait for it (the controller is idle meanwhile)."""
        self.queue.put(item)
        try:
            err = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"rank 0 waited {timeout_s:.0f}s for the trainer to finish {item[0]}") from None
        if err is not None:
            raise RuntimeError(f"trainer failed during {item[0]}:\n{err}")

    def stop(self, timeout_s: float) -> None:
        self.queue.put(None)
        self.thread.join(timeout=timeout_s)


def follower_loop(trainer: Trainer, publisher: WeightPublisher, topo: Topology) -> None:
    """Train ranks other than the leader: receive each work item, run it collectively, until None."""
    while True:
        item = broadcast_item(None, topo)
        if item is None:
            return
        run_item(item, trainer, publisher)

"""The train partition's side of the runtime: the work items every train rank runs together (FSDP2 collectives
inside), the leader's trainer thread, and the other train ranks' loop.

On the train leader (global rank 0) a trainer thread takes work items (runtime/messages.py: Train, Publish,
SaveCheckpoint, ExportHF, Stop) from the controller's backend; every item is first broadcast to the other train
ranks (followers), then all of them run it together (`run_work`; colocated mode runs the same function on every
rank, runtime/colocated.py). The leader reports back on its own control-channel inbox, so the controller sees
training the way it sees engines: `train_step_done` (with the step's metrics), `version_published`, and a WorkDone
for the SaveCheckpoint / ExportHF the controller waits on. Before each publication's broadcast the thread has the
backend tell the rollout ranks to join it (`notify`, RuntimeBackend.notify_publication): the rollout ranks must
be in that collective, so the notice is sent from this thread, right before it.

Every blocking step here is a declared wait (runtime/watchdog.py): a work item is a work wait on every train rank
(its FSDP2 collectives), renewed by their progress in it (the trainer reports each micro-batch, the publisher each
bucket, a checkpoint each stage); a follower's wait for the next item is an idle wait on the leader.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import torch.distributed as dist

from runtime import watchdog
from runtime.channel import Channel
from runtime.messages import ExportHF, Publish, SaveCheckpoint, Stop, Train, WorkDone
from runtime.topology import Topology
from runtime.watchdog import Phase, waiting
from sched.events import Event
from sched.metrics import rollout_stats
from trainer.publish import WeightPublisher
from trainer.trainer import Trainer

PublishFn = Callable[[int, bool], None]   # (version, overlapped): publish the trainer's current weights
Report = Callable[[Event], None]


class AsyncSender:
    """Runs the sending half of an overlapped publication in the background, one at a time (StreamRL §4.1: the
    weight transfer of step n overlaps the training of step n + 1). A failure is raised at the next `wait`."""

    def __init__(self, on: Sequence[int]) -> None:
        self.on = on      # the ranks a publication waits on (leader + rollout ranks)
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
            with waiting("the overlapped publication to be sent", on=self.on):
                self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"overlapped weight publication failed:\n{err}")


def run_work(item: Any, trainer: Trainer, publish: PublishFn, ranks: Sequence[int], report: Report | None = None,
             clock: Callable[[], float] = time.time) -> None:
    """Run one work item on this train rank, collectively with the other train ranks (`ranks`). `publish` is the
    mode's way to publish (the leader's broadcast, a follower's share of the gather, colocated mode's in-place engine
    refresh; each declares its own wait); `report` (the rank that reports: the leader) gets `train_step_done`."""
    if isinstance(item, Train):
        call, n = item.call, trainer.step + 1
        cpu0 = time.process_time() - time.thread_time()
        with waiting(f"train step {n}", on=ranks, phase=Phase.TRAIN, step=n):
            metrics = trainer.train_step(item.groups, step=call.step)
        if report is not None:
            # what the rest of this process (on the leader: the controller, its inbox, the watchdog) took of the
            # CPU before and during the call, cumulative (sim/calibrate.py charges it to the simulated trainer)
            other = time.process_time() - time.thread_time()
            cpu = {"other_cpu_start_s": cpu0, "other_cpu_s": other}
            report(Event("train_step_done", clock(), rank=0, version=trainer.step,
                         data={"stepped": call.step, **rollout_stats(item.groups), **floats(metrics), **cpu}))
        if call.publish:
            publish(trainer.step, call.overlap_publish)
    elif isinstance(item, Publish):
        publish(item.version, False)
    elif isinstance(item, SaveCheckpoint):
        with waiting(f"the checkpoint save of step_{trainer.step}", on=ranks, phase=Phase.CHECKPOINT,
                     step=trainer.step):
            trainer.save_checkpoint(item.dir, extra=item.extra, keep_last=item.keep)
    elif isinstance(item, ExportHF):
        with waiting(f"the HF export to {item.dir}", on=ranks, phase=Phase.EXPORT, step=trainer.step):
            trainer.export_hf(item.dir)
    else:
        raise TypeError(f"unknown trainer work item {type(item).__name__}")


def floats(d: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in d.items() if isinstance(v, (int, float))}


def broadcast_item(item: Any, topo: Topology) -> Any:
    holder = [item]
    dist.broadcast_object_list(holder, src=topo.train_ranks[0], group=topo.work_group or topo.train_group)
    return holder[0]


class TrainerThread:
    """The leader's trainer: runs work items in order, off the controller's thread."""

    def __init__(self, trainer: Trainer, publisher: WeightPublisher, topo: Topology, channel: Channel, t0: float,
                 notify: Callable[[int], None]):
        self.trainer, self.publisher, self.topo, self.channel, self.t0 = trainer, publisher, topo, channel, t0
        self.notify = notify
        self.followers = topo.train_ranks[1:]
        self.receivers = [0, *topo.rollout_ranks]   # the publication broadcast
        self.queue: "queue.Queue[Any]" = queue.Queue()
        self.sender = AsyncSender(self.receivers)
        self.thread = threading.Thread(target=self._loop, name="trainer", daemon=True)
        self.thread.start()

    def _clock(self) -> float:
        return time.time() - self.t0

    def _publish(self, version: int, overlapped: bool) -> None:
        """Tell the rollout ranks, then broadcast; overlapped (StreamRL §4.1's asynchronous mode): gather and pack
        now (collective with the followers), send in the background while the next item trains."""
        def send(packed: Any = None) -> None:
            with waiting(f"the publication of weights v{version}", on=self.receivers + self.followers,
                         phase=Phase.PUBLISH, step=version):
                self.notify(version)
                stats = self.publisher.send(packed) if packed is not None else self.publisher.publish(version)
            self.channel.post(Event("version_published", self._clock(), rank=0, version=version,
                                    data=floats(stats)))
        if overlapped:
            with waiting(f"the publication of weights v{version} (gathering)", on=self.topo.train_ranks,
                         phase=Phase.PUBLISH, step=version):
                packed = self.publisher.pack(version)
            self.sender.submit(lambda: send(packed))
        else:
            send()

    def _loop(self) -> None:
        item = None
        try:
            while True:
                item = self.queue.get()
                if self.followers:
                    with waiting(f"the train ranks to take {type(item).__name__}", on=self.followers):
                        broadcast_item(item, self.topo)
                if isinstance(item, Stop):
                    self.sender.wait()
                    return
                run_work(item, self.trainer, self._publish, self.topo.train_ranks, self.channel.post, self._clock)
                if isinstance(item, (SaveCheckpoint, ExportHF)):
                    self.channel.post(WorkDone(type(item).__name__))
        except BaseException:
            err = traceback.format_exc()
            if isinstance(item, (SaveCheckpoint, ExportHF)):
                self.channel.post(WorkDone(type(item).__name__, error=err))
            self.channel.post(Event("rank_failed", self._clock(), rank=0, data={"error": err}))

    def stop(self) -> None:
        self.queue.put(Stop())
        with waiting("the trainer thread to stop", on=self.topo.train_ranks):
            self.thread.join()


def follower_loop(trainer: Trainer, publisher: WeightPublisher, topo: Topology) -> None:
    """Train ranks other than the leader: receive each work item, run it collectively, until Stop. A follower's
    share of any publication (overlapped or not) is the same gather of every bucket."""
    def publish(version: int, overlapped: bool) -> None:
        with waiting(f"the publication of weights v{version} (gathering)", on=topo.train_ranks, phase=Phase.PUBLISH,
                     step=version):
            publisher.publish(version)

    while True:
        with waiting("a work item from the leader (rank 0)", on=[0]):
            item = broadcast_item(None, topo)
        watchdog.progress(f"received {type(item).__name__}")
        if isinstance(item, Stop):
            return
        run_work(item, trainer, publish, topo.train_ranks)

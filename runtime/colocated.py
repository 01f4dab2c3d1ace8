"""Colocated mode (`cluster.colocate = true`): every rank runs an engine *and* a shard of the FSDP2 trainer, taking
turns on the same device. For one-GPU users (NCCL refuses two ranks on one GPU) and as the baseline the
disaggregated papers compare against.

Each rank's main thread runs a ColocatedWorker: the rollout worker's messages plus the trainer's work items
(runtime/messages.py), which the backend sends to every rank at once, so the FSDP2 collectives line up; every rank
runs them with the disaggregated trainer's own `run_work`. A publication is an in-place refresh: every rank gathers
the full weights inside the train group and copies them into its engine, so the engine's version moves with the
trainer's, with no broadcast; the engine's running sequences are recomputed under the new weights, or keep their KV
where the preset's weight sync keeps it (`WeightSync.keeps_kv`: PipelineRL's in-flight update). Rank 0 also runs the
controller, in a second thread, talking to its own worker through the channel's ports.
"""
from __future__ import annotations

import threading
import traceback
from typing import Any, Callable

from runtime.backend import RuntimeBackend
from runtime.channel import CONTROLLER, WORKER
from runtime.messages import ExportHF, Publish, SaveCheckpoint, Stop, Train, WorkDone
from runtime.preempt import Preempted
from runtime.rollout_worker import RolloutWorker
from runtime.train_worker import run_work
from runtime.watchdog import Phase, waiting
from sched.controller import Controller
from sched.decisions import LoadWeights
from trainer.fsdp import full_tensors
from trainer.trainer import Trainer


class ColocatedWorker(RolloutWorker):
    def __init__(self, *args: Any, trainer: Trainer, ranks: list[int], keep_kv: bool = False, **kw: Any):
        super().__init__(*args, **kw)
        self.trainer, self.ranks, self.keep_kv = trainer, ranks, keep_kv

    def sync_engine(self) -> None:
        """Copy the trainer's weights into the engine (collective: every rank gathers its shards' full tensors);
        running sequences keep their KV if `keep_kv`, else are recomputed (LLMEngine.load_weights)."""
        version = self.trainer.step
        running = self.engine.running_with_kv()
        with waiting(f"the engine refresh to v{version}", on=self.ranks, phase=Phase.PUBLISH, step=version):
            self.engine.load_weights(full_tensors(self.trainer.model), version, keep_kv=self.keep_kv)
        self.event("weights_loaded", version=version,
                   data={"running": running, "kept_kv": self.engine.running_with_kv()})

    def publish(self, version: int, overlapped: bool) -> None:
        """Colocated publication: no transfer to overlap, the engine is refreshed in place."""
        if self.rank == 0:
            self.event("version_published", version=version)
        self.sync_engine()

    def start(self) -> None:
        """The engine starts from the trainer's weights (version 0, or the resumed checkpoint's)."""
        self.sync_engine()
        if self.rank == 0:
            self.event("version_published", version=self.trainer.step)
        self.flush()

    def handle(self, msg: Any) -> bool:
        if isinstance(msg, (Train, Publish, SaveCheckpoint, ExportHF)):
            run_work(msg, self.trainer, self.publish, self.ranks, self.outbox.append if self.rank == 0 else None,
                     self.now)
            if isinstance(msg, (SaveCheckpoint, ExportHF)) and self.rank == 0:
                self.channel.post(WorkDone(type(msg).__name__), CONTROLLER)
        elif isinstance(msg, LoadWeights):
            if msg.version != self.engine.version:
                raise RuntimeError(f"rank {self.rank}: colocated engine holds version {self.engine.version}, "
                                   f"told to load {msg.version}")
            self.event("weights_loaded", version=self.engine.version)
        else:
            return super().handle(msg)
        return True


class ColocatedBackend(RuntimeBackend):
    """Trainer work goes to every rank's worker; engine i is rank i."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, to_trainer=self.to_every_rank, **kw)

    def to_every_rank(self, item: Any) -> None:
        for r in range(self.topo.world):
            self.channel.send(item, r, WORKER)

    def stop_workers(self) -> None:
        self.to_every_rank(Stop())


class ControllerThread:
    """Rank 0's controller beside its worker. Errors are kept and re-raised in the main thread."""

    def __init__(self, controller: Controller, backend: ColocatedBackend, finish: Callable[[], None],
                 after_event: Any = None):
        self.controller, self.backend, self.finish, self.after_event = controller, backend, finish, after_event
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="controller", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.controller.run(self.backend, self.after_event)
            self.finish()
        except Preempted:   # its checkpoint is saved (runtime/preempt.py): stop as at the end, without the export
            pass
        except BaseException:
            self.error = traceback.format_exc()
        finally:
            self.backend.stop_workers()

    def join(self) -> None:
        with waiting("the controller thread to finish", on=self.backend.senders):
            self.thread.join()
        if self.error:
            raise RuntimeError(f"controller failed:\n{self.error}")

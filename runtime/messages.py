"""The runtime's messages, one dataclass each. The control channel (runtime/channel.py) pickles them; a receiver
dispatches on the type. Events (sched.events.Event) flow the other way, to the controller.

To a rollout rank, from the leader's backend (runtime/backend.py) only:
    Start                 start requests, or resume interrupted ones from their tokens so far
    sched.decisions.Abort      stop requests; report them aborted (requeued or dropped)
    sched.decisions.Interrupt  take running requests out and hand back their tokens so far (a migration's keep their KV)
    SendKV                     send a migrated request's KV to the rank resuming it (runtime/kv_transfer.py)
    ReceiveWeights             join the publication broadcast and keep the weights in this rank's relay
    sched.decisions.LoadWeights  adopt the relay's weights in the engine (the weight-sync policy says when)
    sched.decisions.ResetEngine  a failed engine's requests were taken back: it may rebuild and rejoin
    Stop                  leave the loop

To the trainer (the leader's trainer thread, broadcast to the other train ranks; in colocated mode, every rank):
    Train                 train_step on the groups; publish the new weights if the call says so
    Publish               publish the current weights (at start-up, so engines start from the trainer's)
    SaveCheckpoint        torch.distributed.checkpoint save (model, optimizer, schedule, `extra`)
    ExportHF              HF-layout safetensors export
    Stop                  leave the loop
and back to the controller, for the two the controller waits on: WorkDone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rl.types import Group, Trajectory
from sched.decisions import TrainCall


@dataclass
class StartRequest:
    """One request a rollout worker starts (or resumes: `partial` holds its tokens so far, their log-probs and
    per-token versions; its seeded draws need no state, engine/sampler.py)."""
    req_id: int
    group_id: int
    sample_index: int
    prompt_index: int
    prompt_ids: list[int]
    answer: str | None
    max_new_tokens: int | None = None      # the prompt's own cap (the run's rollout.max_new_tokens caps it too)
    partial: Trajectory | None = None


@dataclass
class Start:
    requests: list[StartRequest]


@dataclass
class SendKV:
    """Send the KV kept since request `req_id`'s migrating Interrupt to global rank `dst`, whose next Start resumes
    it (a "no KV" transfer if it is no longer kept)."""
    req_id: int
    dst: int


@dataclass
class ReceiveWeights:
    version: int


@dataclass
class Stop:
    pass


@dataclass
class Train:
    call: TrainCall
    groups: list[Group]


@dataclass
class Publish:
    version: int


@dataclass
class SaveCheckpoint:
    dir: str
    extra: dict[str, Any] = field(default_factory=dict)
    keep: int = 1


@dataclass
class ExportHF:
    dir: str


@dataclass
class WorkDone:
    """The trainer finished a SaveCheckpoint or ExportHF the controller waits on (error: its traceback, if any)."""
    work: str
    error: str | None = None

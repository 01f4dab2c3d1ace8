"""The decisions a scheduling policy returns: plain dataclasses, no behaviour beyond a derived flag. The controller
(sched/controller.py) performs them through the request lifecycle (sched/lifecycle.py), which checks each against
the rules every preset keeps; the backends receive the ones that concern them (`Abort`, `Interrupt`, `LoadWeights`,
`TrainCall`, and the elastic pool's on a backend that says `elastic`).

    Submit                       dispatch: pending requests to one engine
    RoundPlan                    dispatch: how a round is composed (`Dispatch.intake` may return one)
    Abort, Interrupt, Migrate    rebalance (Interrupt also weight_sync): stop, hand back or move running requests
    LendEngines, ReturnEngines   rebalance: engines' GPUs to the trainer and back (RollPacker §4.4)
    AddEngines, Reshard          rebalance: scale the rollout pool out (StreamRL §4.2), reshard it (RollPacker §4.2)
    LoadWeights                  weight_sync: an engine adopts a published version
    TrainCall                    update: train these groups; step the optimizer; publish
    ResetEngine                  (the lifecycle, not a policy) a failed engine's requests were taken back
    Joint                        a Design's decisions of one round, by the kind each stands in for
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Submit:
    engine: int
    req_ids: list[int]


@dataclass
class RoundPlan:
    """How a round is composed; `Dispatch.intake` may return one instead of a bare count of fresh prompts."""
    fresh: int = 0               # new prompts pulled from the data source
    prompts: list[Any] = field(default_factory=list)  # PromptItems to run again (they come first), e.g. a long queue
    group_size: int = 0          # requests per prompt (0: the run's group_size)
    kind: str = "normal"         # a label for the log and for other policies ("short", "long", ...)
    keep_groups: int = 0         # speculative round: groups a rebalance module keeps (0: all)
    keep_per_group: int = 0      # speculative round: trajectories kept per group (0: all)

    @property
    def speculative(self) -> bool:
        return bool(self.keep_groups or self.keep_per_group)


@dataclass
class Abort:
    """Stop requests (pending, running or finished ones); the controller routes each to the engine holding it
    (`engine` is advisory) and settles races by the rules of sched/lifecycle.py."""
    engine: int
    req_ids: list[int]
    requeue: bool = False        # True: back to pending (resumed later); False: dropped and counted


@dataclass
class Interrupt:                 # stop, hand back tokens so far (resumable under another version/engine)
    engine: int
    req_ids: list[int]
    dst: int = -1                # a Migrate's destination (its KV may travel there); -1: back to the pending queue


@dataclass
class Migrate:
    src: int
    dst: int
    req_ids: list[int]


@dataclass
class LendEngines:
    """Take these engines out of rollout and give their GPUs to the trainer until a `ReturnEngines` (RollPacker §4.4's
    elastic scale-down). An engine is lent empty: its requests are being migrated away (Migrate) in the same decision
    or earlier. Only on a backend that can (`Views.elastic`); dispatch never places a request on a lent engine."""
    engines: list[int]


@dataclass
class ReturnEngines:
    """Give lent engines back to rollout (their GPUs leave the trainer)."""
    engines: list[int]


@dataclass
class AddEngines:
    """Scale the rollout pool out by `count` engines from the backend's spare capacity (StreamRL §4.2's dynamic
    adjustment: "SGS automatically scales out by increasing its DP size"). New engines start without weights and
    adopt the latest version through the weight sync. Only on a backend that can (`Views.elastic`)."""
    count: int


@dataclass
class Reshard:
    """Reconfigure the rollout pool to tensor-parallel size `tp` on the same GPUs (RollPacker §4.2's parallelism
    planner: "reconfigure TP sizes on a per-step basis"): the pool becomes (engines x current TP) / tp engines, which
    start without weights. Only between rounds (nothing in flight or waiting, no engine lent or loading), to a size
    the backend can reshard to (`Views.tp_sizes`)."""
    tp: int


@dataclass
class LoadWeights:
    """Adopt the newest published weights (at least `version`). `keep_kv` False: the engine's running sequences are
    preempted and their KV recomputed under the new weights when they resume (AReaL v0.3's interrupt: discard the
    KV, recompute it). True: they keep the KV the older weights computed and go on decoding under the new ones
    (PipelineRL's in-flight weight update, arXiv 2509.19128)."""
    engine: int
    version: int
    keep_kv: bool = False


@dataclass
class ResetEngine:
    """Not a policy's decision: the controller's word to a failed engine that its requests were taken back (the
    lifecycle issues it after folding `engine_failed`); what was sent to the engine before is void there, and it
    may rebuild and rejoin (`engine_recovered`)."""
    engine: int


@dataclass
class TrainCall:
    group_ids: list[int]
    step: bool                   # apply the optimizer step after accumulating these groups' gradients
    publish: bool                # broadcast the new weights to the rollout ranks afterwards
    overlap_publish: bool = False  # send them while the next call trains (the trainer waits only for the gather)


@dataclass
class Joint:
    """A Design's decisions of one round (sched/base.py), each in place of what one kind's mechanism returns; None:
    a kind the design does not fill, asked of its own mechanism."""
    submit: list[Submit] | None = None                                                   # Dispatch.admit
    rebalance: list[Abort | Interrupt | Migrate | LendEngines | ReturnEngines | AddEngines | Reshard] | None = None
    weight_sync: list[LoadWeights | Interrupt] | None = None                             # engines_to_load

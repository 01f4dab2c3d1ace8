"""What policies see: the controller's read-only picture of requests, groups, engines and the trainer, maintained
from events (sched/controller.py). Policies read these; only the controller writes them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rl.types import Trajectory
from sched.tables import IN_FLIGHT, GroupTable, RequestTable  # noqa: F401  (IN_FLIGHT re-exported)

if TYPE_CHECKING:
    from sched.base import RoundPlan

@dataclass
class Request:
    """One sample to generate: G of these make a group."""
    req_id: int
    group_id: int
    sample_index: int
    prompt_index: int
    round: int
    prompt_len: int
    state: str = "pending"       # pending | running | finished | aborting | requeueing | aborted | interrupting
    engine: int = -1
    tokens: int = 0              # response tokens so far (as last reported)
    version: int = -1            # weight version it was admitted under
    t_created: float = 0.0
    finished_seq: int = -1       # Views.seq when its trajectory_finished arrived (finish order; -1: not finished)
    partial: Trajectory | None = None  # tokens of earlier parts (all of them so far) when interrupted; resumed on submit
    v_traj: int = -1             # version of the engine it was FIRST admitted to (StaleFlow's V_traj; never changes)
    migrate_to: int = -1         # engine a pending Migrate will resubmit it to once the interrupt lands

    def __setattr__(self, name: str, value: Any) -> None:
        # Keep the owning table's pending index in step with every state change, whoever makes it.
        if name == "state":
            table = self.__dict__.get("_table")
            if table is not None:
                table._track(self, value)
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:  # pickled or deep-copied without its table
        return {k: v for k, v in self.__dict__.items() if k != "_table"}

    @property
    def resumed_tokens(self) -> int:
        """Response tokens carried over from interrupted parts (0 for a fresh request)."""
        return len(self.partial.response_ids) if self.partial is not None else 0


@dataclass
class GroupState:
    group_id: int
    prompt_index: int
    round: int
    size: int
    answer: str | None = None
    finished: int = 0            # samples done decoding
    scored: int = 0              # samples with a reward
    dropped: int = 0             # samples aborted for good (counted, never trained on)
    trajectories: list[Trajectory] = field(default_factory=list)
    consumed: bool = False       # handed to the trainer
    req_ids: list[int] = field(default_factory=list)  # its requests, by sample index
    prompt: Any = None           # its PromptItem (a policy that re-runs a prompt hands it back in a RoundPlan)
    materialized_seq: int = -1   # Views.seq when it materialised (materialisation order; -1: not yet)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in ("scored", "dropped", "consumed", "size"):
            table = self.__dict__.get("_table")
            if table is not None:   # keep the owning table's open/ready indexes in step
                table._track(self)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_table"}

    @property
    def materialized(self) -> bool:
        return self.scored + self.dropped >= self.size and self.scored > 0

    @property
    def void(self) -> bool:
        """Every sample dropped: nothing of it will ever be trained (e.g. a prompt deferred by tail batching)."""
        return self.scored == 0 and self.dropped >= self.size

    @property
    def closed(self) -> bool:
        """Nothing more to do for it: trained, or void."""
        return self.consumed or self.void

    @property
    def version(self) -> int:
        return min((t.version for t in self.trajectories), default=-1)


@dataclass
class EngineView:
    engine: int
    version: int = -1            # weights the engine generates with (-1: none loaded yet)
    running: int = 0             # requests in its batch (as last reported)
    waiting: int = 0             # requests queued at the engine
    kv_used: int = 0
    kv_free: int = 0
    tokens_decoded: int = 0
    loading: bool = False        # a LoadWeights command is in flight
    assigned: int = 0            # requests sent and not yet finished (controller's own count)


@dataclass
class TrainerView:
    version: int = 0             # optimizer steps taken = version of the trainer's weights
    published: int = -1          # latest version available to engines (the backend publishes 0 at start)
    busy: bool = False           # a train call is in flight
    steps_done: int = 0
    groups_consumed: int = 0
    groups_since_step: int = 0   # groups whose gradients are accumulated but not yet stepped


@dataclass
class Views:
    requests: RequestTable = field(default_factory=RequestTable)
    groups: GroupTable = field(default_factory=GroupTable)
    engines: list[EngineView] = field(default_factory=list)
    trainer: TrainerView = field(default_factory=TrainerView)
    round: int = -1                       # id of the latest round started
    round_groups: dict[int, list[int]] = field(default_factory=dict)  # round -> its group ids
    plans: dict[int, "RoundPlan"] = field(default_factory=dict)        # round -> how it was composed
    now: float = 0.0
    seq: int = 0                          # events applied so far (orders finishes and materialisations)
    materialized: int = 0                 # groups materialised so far (a cheap "anything new?" for handoffs)
    dropped: int = 0                      # samples dropped so far (likewise: a group may have become void)
    params: dict[str, Any] = field(default_factory=dict)  # run-level knobs: group_size, prompts_per_step, ...
    shared: dict[str, Any] = field(default_factory=dict)  # state several mechanisms of one paper share (e.g.
    #                                                     StaleFlow's staleness buffers); checkpointed by its owner

    def __post_init__(self) -> None:
        if not isinstance(self.requests, RequestTable):
            self.requests = RequestTable(self.requests)
        if not isinstance(self.groups, GroupTable):
            self.groups = GroupTable(self.groups)

    def pending(self) -> list[Request]:
        """Requests not yet sent to an engine (fresh, requeued or interrupted), oldest (lowest id) first."""
        return self.requests.pending()

    def open_groups(self) -> list[GroupState]:
        """Groups not yet closed (neither trained nor void), in group-id (submission) order."""
        return self.groups.open()

    def ready_groups(self) -> list[GroupState]:
        """Materialised groups not yet handed to the trainer, in group-id (submission) order."""
        return self.groups.ready()

    def round_done(self, r: int) -> bool:
        """Every group of round r is materialised or void (False for a round this controller has no groups of)."""
        gids = self.round_groups.get(r)
        return bool(gids) and all(self.groups[g].materialized or self.groups[g].void for g in gids)

    def completes_round(self, group_ids: list[int]) -> bool:
        """Training these groups leaves nothing of their round to train: every other group of it is closed."""
        batch = set(group_ids)
        r = self.groups[group_ids[0]].round
        return all(g in batch or self.groups[g].closed for g in self.round_groups.get(r, []))

    def engines_at(self, version: int) -> bool:
        return all(e.version == version and not e.loading for e in self.engines)

    def in_flight(self) -> int:
        return self.requests.count(*IN_FLIGHT)



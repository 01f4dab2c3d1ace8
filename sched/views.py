"""What policies see: the controller's picture of requests, groups, engines and the trainer, built from events. This
module owns the requests and groups (`RequestState` and its named sets, `Request`, `GroupState`) and `Views`, the
whole picture with the accessors policies share; the engines' and the trainer's parts are in sched/resources.py.

Policies read these and never write them: the controller's request lifecycle (sched/lifecycle.py) makes every
change and keeps the tables' indexes in step; a policy that set `r.state` or `e.assigned` would desynchronise them
(keep local copies instead, as `sched/policies/sync.py`'s FIFO dispatch does with its `load`).

A request's life (sched/lifecycle.py has the rules):

    PENDING --submit--> RUNNING --trajectory_finished--> FINISHED
    RUNNING --Abort--> ABORTING --(engine confirms, or it finished first)--> ABORTED    (dropped, counted)
    RUNNING --Abort(requeue)--> REQUEUEING --(engine confirms)--> PENDING               (or FINISHED if it won)
    RUNNING --Interrupt / Migrate--> INTERRUPTING --trajectory_interrupted--> PENDING   (with its tokens so far)
    PENDING / FINISHED --Abort--> ABORTED                                               (never sent / discarded)
    RUNNING / INTERRUPTING / REQUEUEING --engine_failed--> PENDING (tokens from the pool); ABORTING --> ABORTED
    (checkpoint) anything not yet scored --> RESTORED --(every engine holds the checkpoint's weights)--> PENDING
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from rl.types import Trajectory
from sched.resources import DecodeProfile, EngineView, TrainerView
from sched.group_table import GroupTable
from sched.tables import RequestTable

if TYPE_CHECKING:
    from sched.decisions import RoundPlan


class RequestState(str, enum.Enum):
    PENDING = "pending"            # in the controller, waiting for dispatch (fresh, requeued, or interrupted)
    RUNNING = "running"            # sent to an engine
    FINISHED = "finished"          # decoded; its reward may still be on its way
    ABORTING = "aborting"          # dropped; the abort is on its way to the engine
    REQUEUEING = "requeueing"      # sent back to pending; the engine has not confirmed yet
    INTERRUPTING = "interrupting"  # asked to hand back its tokens so far (Interrupt, Migrate)
    ABORTED = "aborted"            # dropped for good: counted, never trained
    RESTORED = "restored"          # restored from a checkpoint: generated again once the engines hold its weights

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


S = RequestState
ON_ENGINE = (S.RUNNING, S.ABORTING, S.REQUEUEING, S.INTERRUPTING)  # an engine holds it: sent, not yet given back
LIVE = (S.PENDING, S.RUNNING, S.REQUEUEING, S.INTERRUPTING)        # it will still yield a trajectory
IN_FLIGHT = (S.PENDING,) + ON_ENGINE                               # not settled: indexed by the request table
ABORTABLE = (S.PENDING, S.RUNNING, S.FINISHED, S.INTERRUPTING)     # an Abort(requeue=False) drops it (not yet
#                                                                   aborting or aborted; interrupting: being moved)
REGENERATE = LIVE + (S.RESTORED,)                                  # generated again after a resume
# (tuples, not sets: a set of str-valued members iterates in a per-process hash order)


@dataclass(eq=False, slots=True)
class Request:
    """One sample to generate: G of these make a group."""
    req_id: int
    group_id: int
    sample_index: int
    prompt_index: int
    round: int
    prompt_len: int
    state: RequestState = RequestState.PENDING
    engine: int = -1
    tokens: int = 0              # response tokens so far (as last reported)
    version: int = -1            # weight version it was admitted under
    t_created: float = 0.0
    finished_seq: int = -1       # Views.seq when its trajectory_finished arrived (finish order; -1: not finished)
    preemptions: int = 0         # KV preemptions it went through (reported with its trajectory_finished, if at all)
    partial: Trajectory | None = None  # all tokens so far of an interrupted request; resumed from there on submit
    v_traj: int = -1             # version of the engine it was FIRST admitted to (StaleFlow's V_traj; never changes)
    migrate_to: int = -1         # engine a pending Migrate will resubmit it to once the interrupt lands
    tool_since: float = -1.0     # multi-turn: when it began waiting on a tool call (-1: not waiting)
    tool_calls: int = 0          # multi-turn: tool calls it started (this attempt)

    @property
    def on_tool(self) -> bool:   # waiting on a tool call: on its engine, holding KV, not decoding (rl/env.py)
        return self.tool_since >= 0

    def __post_init__(self) -> None:
        if type(self.state) is not RequestState:   # e.g. a checkpoint's "pending": checked and converted
            self.state = RequestState(self.state)

    @property
    def resumed_tokens(self) -> int:
        """Response tokens carried over from interrupted parts (0 for a fresh request)."""
        return len(self.partial.response_ids) if self.partial is not None else 0


@dataclass(eq=False, slots=True)
class GroupState:
    group_id: int
    prompt_index: int
    round: int
    size: int
    answer: str | None = None
    scored: int = 0              # samples with a reward
    dropped: int = 0             # samples aborted for good (counted, never trained on)
    trajectories: list[Trajectory] = field(default_factory=list)
    consumed: bool = False       # handed to the trainer
    req_ids: list[int] = field(default_factory=list)  # its requests, by sample index
    prompt: Any = None           # its PromptItem (a policy that re-runs a prompt hands it back in a RoundPlan)
    materialized_seq: int = -1   # Views.seq when it materialised (materialisation order; -1: not yet)

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


def least_loaded(load: Mapping[int, float]) -> int:
    """The engine with the least load; the lowest id among equals."""
    return min(load, key=lambda i: (load[i], i))


@dataclass
class Views:
    group_size: int = 1                   # G: requests per prompt (a RoundPlan may ask for another size)
    prompts_per_step: int = 1             # prompts (groups) per round, the run's training batch in groups
    requests: RequestTable = field(default_factory=lambda: RequestTable(IN_FLIGHT, S.PENDING, ON_ENGINE))
    groups: GroupTable = field(default_factory=GroupTable)
    engines: list[EngineView] = field(default_factory=list)
    trainer: TrainerView = field(default_factory=TrainerView)
    round: int = -1                       # id of the latest round started
    round_groups: dict[int, list[int]] = field(default_factory=dict)  # round -> its group ids
    plans: dict[int, "RoundPlan"] = field(default_factory=dict)        # round -> how it was composed
    migrations: list[tuple[int, int, int]] = field(default_factory=list)  # (req_id, src, dst): interrupted by a
    #                                                                 Migrate, resubmitted to dst at the next decision
    finishes: dict[int, list[int]] = field(default_factory=dict)      # round -> its req ids in finish order (every
    #                                                                 trajectory_finished, discarded ones included)
    now: float = 0.0
    seq: int = 0                          # events applied so far (orders finishes and materialisations)
    materialized: int = 0                 # groups materialised so far (a cheap "anything new?" for handoffs)
    dropped: int = 0                      # samples dropped so far (likewise: a group may have become void)
    finished: int = 0                     # trajectory_finished events folded (likewise, for readers of `finishes`)
    elastic: bool = False                 # the backend can lend an engine's GPUs to the trainer (LendEngines)
    decode_profile: DecodeProfile | None = None   # the engines' profiled decode step, when the backend has one
    colocated: bool = False               # engines and trainer share the same GPUs (a train call pauses rollout)
    tp: int = 1                           # GPUs per rollout engine (tensor-parallel size), as the backend reports
    tp_sizes: tuple[int, ...] = ()        # the TP sizes the backend can reshard the pool to (empty: none)
    switch_s: float = 0.0                 # s an engine takes to go to the trainer or back, as the backend reports
    kv_block_size: int = 0                # tokens per KV block (the unit of EngineView.kv_used / kv_free); 0: unknown

    # ------------------------------------------------------------------------------------------------ requests
    def pending(self) -> list[Request]:
        """Requests not yet sent to an engine (fresh, requeued or interrupted), oldest (lowest id) first."""
        return self.requests.pending()

    def pending_by_group(self) -> dict[int, list[int]]:
        """Pending request ids by group, groups in ascending id (submission) order (a group's requests have
        consecutive ids, so the id-ordered pending queue meets its groups in that order)."""
        out: dict[int, list[int]] = {}
        for r in self.requests.iter_pending():
            ids = out.get(r.group_id)
            if ids is None:
                out[r.group_id] = [r.req_id]
            else:
                ids.append(r.req_id)
        return out

    def round_finishes(self, r: int) -> list[int]:
        """Round r's request ids in the order their trajectory_finished arrived (a policy keeps a cursor into it
        to read only the new ones; forgotten with the round)."""
        return self.finishes.get(r, [])

    def in_flight(self) -> int:
        return self.requests.count(*IN_FLIGHT)

    def migrating_to(self, engine: int) -> bool:
        """Whether trajectories are on their way to `engine`: a Migrate there is issued and its requests are not
        yet resubmitted (interrupting, or interrupted and awaiting resubmission)."""
        return (any(r.migrate_to == engine for r in self.requests.in_state(S.INTERRUPTING))
                or any(dst == engine for _, _, dst in self.migrations))

    # -------------------------------------------------------------------------------------------------- groups
    def open_groups(self) -> list[GroupState]:
        """Groups not yet closed (neither trained nor void), in group-id (submission) order."""
        return self.groups.open()

    def ready_groups(self) -> list[GroupState]:
        """Materialised groups not yet handed to the trainer, in group-id (submission) order."""
        return self.groups.ready()

    def ready_in_oldest_round(self) -> tuple[list[GroupState], bool]:
        """Ready groups of the oldest round that has any, in materialisation order, and whether they are all that
        round will ever yield (every other group of it is closed)."""
        ready = self.ready_groups()
        if not ready:
            return [], False
        r = min(g.round for g in ready)
        mine = sorted((g for g in ready if g.round == r), key=lambda g: (g.materialized_seq, g.group_id))
        rest = any(not (g := self.groups[gid]).closed and not g.materialized for gid in self.round_groups.get(r, []))
        return mine, not rest

    def round_done(self, r: int) -> bool:
        """Every group of round r is materialised or void (False for a round this controller has no groups of)."""
        gids = self.round_groups.get(r)
        return bool(gids) and all(self.groups[g].materialized or self.groups[g].void for g in gids)

    def completes_round(self, group_ids: list[int]) -> bool:
        """Training these groups leaves nothing of their round to train: every other group of it is closed."""
        batch = set(group_ids)
        r = self.groups[group_ids[0]].round
        return all(g in batch or self.groups[g].closed for g in self.round_groups.get(r, []))

    # ------------------------------------------------------------------------------------------------- engines
    def engines_at(self, version: int) -> bool:
        return all(e.version == version and not e.loading for e in self.engines)

    def engine_loads(self) -> dict[int, int]:
        """Requests assigned to each engine in rollout (engine id -> count; engines lent to the trainer are left
        out), for a dispatch's local bookkeeping."""
        return {e.engine: e.assigned for e in self.engines if not e.lent}

    def rollout_engines(self) -> list[int]:
        """Ids of the engines in rollout (not lent to the trainer)."""
        return [e.engine for e in self.engines if not e.lent]

    # --------------------------------------------------------------------------------------------------- tests
    def check(self) -> None:
        """Raise AssertionError if the views contradict themselves: an index out of step with the states and
        counts, or an engine's `assigned` unlike the requests it holds (what a policy that wrote the views, instead
        of keeping local copies, would cause). O(requests): the tests call it after every decision."""
        self.requests.check()
        self.groups.check()
        held = {e.engine: 0 for e in self.engines}
        for r in self.requests.in_state(*ON_ENGINE):
            held[r.engine] += 1
        for e in self.engines:
            assert e.assigned == held[e.engine], f"engine {e.engine}: assigned {e.assigned}, holds {held[e.engine]}"

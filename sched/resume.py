"""The controller's trajectory state in a checkpoint, so a run can be checkpointed mid-round and resumed with
nothing lost and nothing trained twice (Controller.state_dict / load_state_dict call these).

`save_views(life)` returns plain containers (dicts, lists, numbers, strings: what `torch.load(..., weights_only=True)`
reads back): the live rounds with their plans, every group with its prompt and the trajectories it holds
(finished, scored and not yet consumed ones included), every request with its state and its `partial` trajectory,
and the set of trajectories already handed to the trainer.

`load_views(life, state)` rebuilds the views in a fresh controller whose engines know nothing of the old run:

    finished + scored     kept as they are (its trajectory is in its group, trained later exactly once)
    finished, unscored    its reward never arrived: generated again
    pending, running,     generated again; a request with a `partial` trajectory keeps it and resumes from its
    requeueing,           tokens so far (the engine re-prefills them), otherwise it starts afresh (its per-sample
    interrupting          seed makes the new tokens equal the lost ones under the same weights)
    aborting              aborted (it was already counted dropped; its engine's confirmation will never come)
    aborted               kept

Requests to be generated again are RESTORED (invisible to dispatch) until every engine has loaded the version the
trainer had at the checkpoint, then released as PENDING (`EventFold.release_restored`, on each `weights_loaded`):
fresh engines start with no weights, and a barrier weight sync never loads an engine with requests assigned.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

from rl.types import Trajectory
from sched.events import Event
from sched.views import REGENERATE, GroupState, Request, RequestState

if TYPE_CHECKING:
    from sched.lifecycle import Lifecycle

S = RequestState
_TAG = "__dataclass__"


def _types() -> dict[str, type]:
    from sched.controller import PromptItem
    from sched.decisions import RoundPlan
    return {c.__name__: c for c in (Request, GroupState, Trajectory, PromptItem, RoundPlan)}


def encode(obj: Any) -> Any:
    """Dataclasses of the views (by declared fields only), containers, enums and scalars -> plain containers."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if type(obj).__name__ not in _types():
            raise TypeError(f"cannot checkpoint a {type(obj).__name__} in the controller's views")
        out = {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        out[_TAG] = type(obj).__name__
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return [encode(v) for v in sorted(obj)]
    return obj


def decode(obj: Any) -> Any:
    """The inverse of `encode` (tuples come back as lists)."""
    if isinstance(obj, dict):
        if _TAG in obj:
            cls = _types()[obj[_TAG]]
            names = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: decode(v) for k, v in obj.items() if k in names})
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj


def save_views(life: "Lifecycle") -> dict[str, Any]:
    """Everything of the views a resumed run needs (see the module docstring). Engines are not saved."""
    v = life.v
    return {
        "requests": [encode(r) for r in v.requests.values()],
        "groups": [encode(g) for g in v.groups.values()],
        "round_groups": {r: list(g) for r, g in v.round_groups.items()},
        "plans": {r: encode(p) for r, p in v.plans.items()},
        "trained": [list(k) for k in sorted(life.trained)],
        "next_req": life.next_req,
        "next_group": life.next_group,
        "seq": v.seq,
        "materialized": v.materialized,
        "dropped": v.dropped,
        "now": v.now,
        "interrupted": life.fold.interrupted,
        "floor": v.trainer.version,
    }


def load_views(life: "Lifecycle", state: dict[str, Any]) -> None:
    """Rebuild the controller's views from `save_views` output; requests to generate again are RESTORED."""
    v = life.v
    v.groups.clear()
    for g in map(decode, state["groups"]):
        v.groups[g.group_id] = g
    v.round_groups = {int(r): list(g) for r, g in state["round_groups"].items()}
    v.plans = {int(r): decode(p) for r, p in state["plans"].items()}
    life.trained = {(int(g), int(s)) for g, s in state["trained"]}
    life.next_req, life.next_group = state["next_req"], state["next_group"]
    v.seq, v.now, v.materialized, v.dropped = state["seq"], state["now"], state["materialized"], state["dropped"]
    life.fold.interrupted = state["interrupted"]
    v.migrations = []
    v.requests.clear()
    for r in map(decode, state["requests"]):
        _settle(life, r)
        v.requests[r.req_id] = r
    life.fold.restore_floor = state["floor"]


def _settle(life: "Lifecycle", r: Request) -> None:
    """What becomes of one request whose engine is gone (the table in the module docstring); r is not yet in the
    request table, so its state is set directly."""
    g = life.v.groups.get(r.group_id)
    scored = g is not None and any(t.sample_index == r.sample_index for t in g.trajectories)
    if r.state == S.ABORTING:
        r.state = S.ABORTED
        life.emit(Event("trajectory_aborted", life.v.now, engine=r.engine, req_id=r.req_id, group_id=r.group_id,
                        data={"requeue": False, "restored": True}))
    elif r.state in REGENERATE or (r.state == S.FINISHED and not scored):
        r.state, r.engine, r.finished_seq, r.migrate_to = S.RESTORED, -1, -1, -1
        r.tool_since = -1.0   # a tool call it waited on went with its engine
        r.tokens = len(r.partial.response_ids) if r.partial is not None else 0
        if r.partial is None:
            r.v_traj = -1  # its tokens will all be new: first admitted on resume

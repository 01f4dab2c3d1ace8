"""The controller's trajectory state in a checkpoint, so a run can be checkpointed mid-round and resumed with
nothing lost and nothing trained twice (Controller.state_dict / load_state_dict call these).

`save_views(ctl)` returns plain containers (dicts, lists, numbers, strings, tensors: what `torch.load(...,
weights_only=True)` reads back): the live rounds with their plans and prompts, every group with the trajectories
it holds (finished, scored and not yet consumed ones included), every request with its state and its `partial`
trajectory, and the set of trajectories already handed to the trainer.

`load_views(ctl, state)` rebuilds the views in a fresh controller whose engines know nothing of the old run:

    finished + scored     kept as they are (its trajectory is in its group, trained later exactly once)
    finished, unscored    its reward never arrived: generated again
    pending, running,     generated again; a request with a `partial` trajectory keeps it and resumes from its
    requeueing,           tokens so far (the engine re-prefills them), otherwise it starts afresh (its per-sample
    interrupting          seed makes the new tokens equal the lost ones under the same weights)
    aborting              "aborted" (it was already counted dropped; its engine's confirmation will never come)
    aborted               kept

Requests to be generated again are "held" (invisible to dispatch) until every engine has loaded the version the
trainer had at the checkpoint, then released as "pending" (`release_held`, called on each `weights_loaded`):
fresh engines start with no weights, and a barrier weight sync never loads an engine with requests assigned.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rl.types import Trajectory
from sched.events import Event
from sched.views import GroupState, Request

if TYPE_CHECKING:
    from sched.controller import Controller

HELD = "held"
REGENERATE = ("pending", "running", "requeueing", "interrupting", HELD)
_TAG = "__dataclass__"


def _types() -> dict[str, type]:
    from sched.base import RoundPlan
    from sched.controller import PromptItem
    return {c.__name__: c for c in (Request, GroupState, Trajectory, PromptItem, RoundPlan)}


def encode(obj: Any) -> Any:
    """Dataclasses of the views (by declared fields only), containers and scalars -> plain containers."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if type(obj).__name__ not in _types():
            raise TypeError(f"cannot checkpoint a {type(obj).__name__} in the controller's views")
        out = {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        out[_TAG] = type(obj).__name__
        return out
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


def save_views(ctl: "Controller") -> dict[str, Any]:
    """Everything of the views a resumed run needs (see the module docstring). Engines are not saved."""
    v = ctl.v
    return {
        "requests": [encode(r) for r in v.requests.values()],
        "groups": [encode(g) for g in v.groups.values()],
        "round_groups": {r: list(g) for r, g in v.round_groups.items()},
        "plans": {r: encode(p) for r, p in v.plans.items()},
        "prompts": {gid: encode(p) for gid, p in ctl.prompts.items()},
        "trained": [list(k) for k in sorted(ctl.trained)],
        "seq": v.seq,
        "materialized": getattr(v, "materialized", 0),
        "now": v.now,
        "interrupted": getattr(ctl, "interrupted", 0),
        "floor": v.trainer.version,
    }


def load_views(ctl: "Controller", state: dict[str, Any]) -> None:
    """Rebuild the controller's views from `save_views` output; requests to generate again are held."""
    v = ctl.v
    v.groups = type(v.groups)()      # the views' own indexed tables (open / ready groups, pending requests)
    for g in map(decode, state["groups"]):
        v.groups[g.group_id] = g
    v.round_groups = {int(r): list(g) for r, g in state["round_groups"].items()}
    v.plans = {int(r): decode(p) for r, p in state["plans"].items()}
    ctl.prompts = {int(gid): decode(p) for gid, p in state["prompts"].items()}
    for gid, g in v.groups.items():  # one PromptItem object per group, as start_round makes it
        if gid in ctl.prompts:
            g.prompt = ctl.prompts[gid]
    ctl.trained = {(int(g), int(s)) for g, s in state["trained"]}
    v.seq, v.now = state["seq"], state["now"]
    if hasattr(v, "materialized"):
        v.materialized = state.get("materialized", 0)
    if hasattr(ctl, "interrupted"):
        ctl.interrupted = state.get("interrupted", 0)
    if hasattr(ctl, "migrations"):
        ctl.migrations = []
    v.requests = type(v.requests)()
    for r in map(decode, state["requests"]):
        _settle(ctl, r)
        v.requests[r.req_id] = r
    ctl.resume_floor = state["floor"]


def _settle(ctl: "Controller", r: Request) -> None:
    """What becomes of one request whose engine is gone (the table in the module docstring)."""
    g = ctl.v.groups.get(r.group_id)
    scored = g is not None and any(t.sample_index == r.sample_index for t in g.trajectories)
    if r.state == "aborting":
        r.state = "aborted"
        ctl.emit(Event("trajectory_aborted", ctl.v.now, engine=r.engine, req_id=r.req_id, group_id=r.group_id,
                       data={"requeue": False, "restored": True}))
    elif r.state in REGENERATE or (r.state == "finished" and not scored):
        r.state, r.engine, r.finished_seq = HELD, -1, -1
        if hasattr(r, "migrate_to"):
            r.migrate_to = -1
        partial = getattr(r, "partial", None)
        r.tokens = len(partial.response_ids) if partial is not None else 0
        if partial is None and hasattr(r, "v_traj"):
            r.v_traj = -1  # its tokens will all be new: first admitted on resume


def held(ctl: "Controller") -> list[Request]:
    return [r for r in ctl.v.requests.values() if r.state == HELD]


def release_held(ctl: "Controller") -> int:
    """Once every engine holds at least the trainer's checkpointed version (and is not loading), make the held
    requests pending again; returns how many were released."""
    floor = getattr(ctl, "resume_floor", None)
    if floor is None:
        return 0
    engines = ctl.v.engines
    if not engines or any(e.version < floor or e.loading for e in engines):
        return 0
    out = held(ctl)
    for r in out:
        r.state = "pending"
    ctl.resume_floor = None
    return len(out)

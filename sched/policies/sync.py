"""The synchronous baseline (Slime / veRL style, what every paper compares against; RolloutPipe §2.1 describes it):
generate a whole round with one weight version, train on all of it in one optimizer step, publish, let every
engine adopt the new version, start the next round (configs/sched/sync.toml).

    fifo          dispatch     every pending group at once, whole, to the engine with the fewest requests
    whole_round   handoff      the round's materialised groups once every group of it is materialised or void
    round_minibatches  handoff  the same barrier, then the round U groups at a time (Slime's logical updates)
    step_publish  update       one optimizer step and one publication per batch
    barrier       weight_sync  an engine adopts the latest published version once it has nothing in flight
    none          rebalance    never touches running trajectories

Slime (configs/sched/slime.toml, RolloutPipe's baseline, §2.1 / §3.1 "the optimizer-step and weight-publish
boundaries follow Slime") is the same barrier with Slime's update schedule: after the barrier the round goes to the
trainer U groups at a time, one optimizer step each (R / U per round, RolloutPipe's `every_u`), one publication
after the last.

Invariants kept: a group never spans engines; a batch is exactly one round, so all its samples share the round's
generating version; the published version counts optimizer steps; an engine never changes weights under a running
trajectory, so each trajectory is generated under exactly one version.
"""
from __future__ import annotations

from dataclasses import dataclass

from config import F
from sched.base import Dispatch, Handoff, Rebalance, Update, WeightSync, register
from sched.decisions import LoadWeights, Submit, TrainCall
from sched.views import RequestState, Views, least_loaded


@register
class FifoDispatch(Dispatch):
    """Every pending request at once, oldest group first, each whole group to the engine with the fewest requests
    assigned, so the G samples of a group share their prompt's KV blocks on one engine; the engine's continuous
    batching decides what runs when. Intake: the base class's synchronous rounds."""
    name = "fifo"
    paper = "baseline: synchronous rounds (Slime / veRL)"

    def admit(self, v: Views) -> list[Submit]:
        if not v.requests.count(RequestState.PENDING):
            return []
        load = v.engine_loads()
        out: dict[int, list[int]] = {}
        for ids in v.pending_by_group().values():
            eng = least_loaded(load)
            out.setdefault(eng, []).extend(ids)
            load[eng] += len(ids)
        return [Submit(e, ids) for e, ids in sorted(out.items())]


@register
class WholeRound(Handoff):
    """Nothing until every group of the current round is materialised (or void: every sample dropped, as a prompt
    deferred by tail batching), then all the materialised ones."""
    name = "whole_round"
    paper = "baseline: RolloutPipe §2.1 'Slime submits all groups ... only at rollout completion'"

    def ready(self, v: Views) -> list[int] | None:
        if v.round < 0 or not v.round_done(v.round):
            return None
        gids = [g for g in v.round_groups[v.round] if v.groups[g].materialized and not v.groups[g].consumed]
        return gids or None

    def batch_groups(self, prompts_per_step: int) -> int | None:
        return prompts_per_step


@register
class RoundMinibatches(Handoff):
    """Slime's serial barrier with its logical updates: nothing until every group of the current round is
    materialised (or void), then its materialised groups `groups` (U) at a time in submission (group id) order, one
    train call each. Pair with `every_u` (one optimizer step per U groups, one publication after the round).

    Invariant kept: no group of a round reaches the trainer before the round's last group materialised."""
    name = "round_minibatches"
    paper = "baseline: Slime (RolloutPipe §2.1 serial barrier, §3.1 R / U logical updates per round)"

    @dataclass
    class Params:
        groups: int = F(2, ge=1, help="U: groups per logical update (one train call, one optimizer step each)")

    def ready(self, v: Views) -> list[int] | None:
        if v.round < 0 or not v.round_done(v.round):
            return None
        gids = [g for g in v.round_groups[v.round] if v.groups[g].materialized and not v.groups[g].consumed]
        return gids[:self.p.groups] or None

    def batch_groups(self, prompts_per_step: int) -> int | None:
        return min(self.p.groups, prompts_per_step)


@register
class StepAndPublish(Update):
    """Every training batch is one optimizer step followed by a weight publication."""
    name = "step_publish"
    paper = "baseline: one step and one publication per batch"

    def decide(self, group_ids: list[int], v: Views) -> TrainCall:
        return TrainCall(group_ids, step=True, publish=True)


@register
class Barrier(WeightSync):
    """An engine adopts the latest published version as soon as it has nothing in flight and no request waits to be
    admitted (a dispatch that holds requests back places them under the version their round started on); with
    synchronous intake no round starts before every engine has adopted it; an engine lent to the trainer, once it
    is back."""
    name = "barrier"
    paper = "baseline: global weight sync between rounds"

    def engines_to_load(self, v: Views) -> list[LoadWeights]:
        latest = v.trainer.published
        if v.requests.count(RequestState.PENDING):
            return []
        return [LoadWeights(e.engine, latest) for e in v.engines
                if e.version < latest and not e.loading and e.assigned == 0 and not e.lent]


@register
class NoRebalance(Rebalance):
    """Never touches running trajectories (every on-policy preset)."""
    name = "none"
    paper = "baseline: no rebalancing"

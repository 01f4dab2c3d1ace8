"""RolloutPipe (configs/sched/rolloutpipe.toml): rounds stay synchronous and on-policy (one rollout weight version
per round), but complete groups pipeline into the trainer as they materialise, and admission serves only the
earliest unfinished groups.

    frontier  dispatch     frontier-group dispatch, FGD (§3.3, Algorithm 1 lines 8-12, Eq. 5-6); `mode` reads it as
                           a hard cap (default) or as frontier-first order over FIFO
    cgp       handoff      complete-group pipelining, CGP (§3.2, Algorithm 1 lines 13-19)
    every_u   update       one optimizer step per U groups, one publication per round (§3.2, Alg. 1 lines 20-22)

Paper setting: K = 8, B = 16, so U = B / K = 2 and F_w = U = 2 groups per rollout engine (the paper's one engine:
2 A100s, TP = 2).
"""
from __future__ import annotations

from dataclasses import dataclass

from config import F
from sched.base import Dispatch, Handoff, Update, register
from sched.decisions import Submit, TrainCall
from sched.views import RequestState, Views, least_loaded

S = RequestState


def frontier(v: Views, width: int) -> list[int]:
    """The `width` earliest groups that are not serving-complete (Eq. 5). Pending requests come in id order, which
    is group order, so the first `width` distinct groups among them are all that can make the cut."""
    live = {r.group_id for r in v.requests.in_state(S.RUNNING, S.REQUEUEING, S.INTERRUPTING)}
    extra: set[int] = set()
    for r in v.requests.iter_pending():
        if r.group_id not in live:
            extra.add(r.group_id)
            if len(extra) >= width:
                break
    return sorted(live | extra)[:width]


@register
class FrontierDispatch(Dispatch):
    """FGD. Request-level FIFO admission is blind to groups: with all R x K requests admitted at once, groups
    complete in a random order and the trainer, which needs whole groups, waits for stragglers of every group (the
    "frontier-group arrival gap", §2.2). The paper gives FGD two readings; `mode` selects one:

    "cap" (§3.3's text, Eq. 5-6; the default): serve at most F_w groups per engine at a time, the earliest submitted:

        O = groups with a request not yet done (pending, running, being requeued or interrupted)
        F = the F_w x N lowest-order groups of O        (Eq. 5 for N engines; order = group id = submission order)
        a pending request is admitted iff its group is in F, else it waits ("Deferred Groups")   (Eq. 6)

    A group leaves F once all its requests are finished or dropped ("serving-complete"), and the next deferred
    group takes the slot on the next decision; F need not be contiguous. Within F the engine's own continuous
    batching decides what runs.

    "first" (the abstract's "first admits", §1's and §5.2's "prioritizes", Fig. 3's and §7's "frontier-first
    admission"): every pending group is admitted, as under FIFO, the groups of F first, then the rest in order.
    Where an engine admits in submission order, as ours does, this is FIFO's own order (the frontier's pending
    groups are always the lowest-order pending ones): the reading adds no mechanism beyond FIFO's there.

    Intake: synchronous rounds.

    Invariant kept: a group never spans engines (requeued requests of a group return to the engine that serves
    the rest of it); under "cap" at most F_w x N groups are ever in service; under "first" no pending request is
    held back, and on each engine the frontier's requests are queued before any other group's."""
    name = "frontier"
    paper = "RolloutPipe §3.3, Algorithm 1 lines 8-12, Eq. 5-6"

    @dataclass
    class Params:
        width: int = F(2, ge=1, help="F_w: groups in service at once per engine (the frontier holds F_w x engines)")
        mode: str = F("cap", choices=("cap", "first"),
                      help="cap: admit only the frontier's groups (§3.3, Eq. 6); first: admit every pending group as "
                           "FIFO does, the frontier's first (the abstract's 'first admits')")

    def admit(self, v: Views) -> list[Submit]:
        load = v.engine_loads()
        out: dict[int, list[int]] = {}
        front = frontier(v, self.p.width * len(v.engines))
        if self.p.mode == "first":
            pending = v.pending_by_group()
            if not pending:
                return []
            inside = set(front)
            front = [g for g in front if g in pending] + [g for g in pending if g not in inside]
        for gid in front:
            reqs = [v.requests[i] for i in v.groups[gid].req_ids]
            todo = [r.req_id for r in reqs if r.state == S.PENDING]
            if not todo:
                continue
            serving = [r.engine for r in reqs if r.engine >= 0 and r.state in (S.RUNNING, S.REQUEUEING)]
            eng = serving[0] if serving else least_loaded(load)
            out.setdefault(eng, []).extend(todo)
            load[eng] += len(todo)
        return [Submit(e, ids) for e, ids in sorted(out.items())]


@register
class CompleteGroupPipelining(Handoff):
    """CGP. Under GRPO the trainable unit is the complete, materialised group, so instead of Slime's barrier at
    rollout completion each group enters a FIFO the moment it materialises, and the earliest U go to the trainer as
    soon as U are there: the trainer starts at t_first^(U) instead of t_complete (Eq. 2). The FIFO is in
    materialisation order; when the rest of a round is fewer than U groups they go together once nothing else of
    the round can arrive. Pair with `every_u`. The paper's Feasible Batch Selector (a per-GPU token budget) is the
    trainer's own micro-batching here.

    Invariant kept: batches are whole materialised groups of a single round, each handed over once."""
    name = "cgp"
    paper = "RolloutPipe §3.2, Algorithm 1 lines 13-19"

    @dataclass
    class Params:
        groups: int = F(2, ge=1, help="U = B / K: complete groups per logical update")

    def ready(self, v: Views) -> list[int] | None:
        queue, last = v.ready_in_oldest_round()
        if len(queue) >= self.p.groups or (queue and last):
            return [g.group_id for g in queue[:self.p.groups]]
        return None

    def batch_groups(self, prompts_per_step: int) -> int | None:
        return min(self.p.groups, prompts_per_step)


@register
class EveryU(Update):
    """"The optimizer step triggers only when accumulation reaches U" complete groups, and weights are published
    only "once all R groups of the current rollout are consumed" (§3.1), so a round of R groups takes R/U steps but
    the engines see one new version per round. A batch of fewer than U groups only accumulates gradients; the
    round's last batch always steps. On-policy in the paper's sense: every sample of the round was generated by
    the weights the round started from, and the trainer's ratio uses those log-probs (`Trajectory.logprobs`).

    Invariant kept: publish only after the round's last group, so the next round (synchronous intake) starts from
    the weights of all R/U steps and no engine ever sees a half-drained round's weights."""
    name = "every_u"
    paper = "RolloutPipe §3.2 / §4, Algorithm 1 lines 20-22"

    @dataclass
    class Params:
        groups: int = F(2, ge=1, help="U: groups per optimizer step")

    def decide(self, group_ids: list[int], v: Views) -> TrainCall:
        last = v.completes_round(group_ids)
        step = last or v.trainer.groups_since_step + len(group_ids) >= self.p.groups
        return TrainCall(group_ids, step=step, publish=last)

    def step_groups(self, batch: int | None, prompts_per_step: int) -> int | None:
        """U, or the whole calls that reach U (calls of `batch` groups), at most a round."""
        calls = batch or 1
        return min(-(-self.p.groups // calls) * calls, prompts_per_step)

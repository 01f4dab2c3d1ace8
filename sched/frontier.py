"""Frontier-group dispatch (FGD): RolloutPipe §3.3, Algorithm 1 lines 8-12, Eq. 5-6.

Request-level FIFO admission is blind to groups: with all R x K requests admitted at once, groups complete in a
random order and the trainer, which needs whole groups, waits for stragglers of every group ("frontier-group
arrival gap", §2.2). FGD serves at most F_w groups at a time, the earliest submitted ones:

    O = groups with a request not yet done (pending, running or being requeued)
    F = the F_w x N lowest-order groups of O          (Eq. 5 for N engines; order = group id = submission order)
    a pending request is admitted iff its group is in F, else it waits ("Deferred Groups")     (Eq. 6)

A group leaves F once all its requests are finished or dropped ("serving-complete"; with tail batching that is
when its surplus responses are aborted), and the next deferred group takes the slot on the next decision. F need
not be contiguous (group 2 finishing before group 1 gives F = {1, 3}). Within F the engine's own continuous
batching decides what runs. F_w counts groups per engine: the paper's rollout node is one engine (2 A100s, TP = 2)
with F_w = U = 2, so N engines serve F_w x N groups, each going whole to the least-loaded engine.
Intake: synchronous rounds.

Invariant kept: at most F_w x N groups are ever in service; a group never spans engines (requeued requests of a
group return to the engine that serves the rest of it).
"""
from __future__ import annotations

from dataclasses import dataclass

from config import F
from sched.base import Dispatch, Submit, Views, register

SERVING = ("running", "requeueing", "interrupting")  # with "pending": a group with such a request is not
#                                                     serving-complete


def frontier(v: Views, width: int) -> list[int]:
    """The F_w earliest groups that are not serving-complete (Eq. 5). Pending requests come in id order, which is
    group order, so the first `width` distinct groups among them are all that can make the cut."""
    live = {r.group_id for r in v.requests.in_state(*SERVING)}
    extra: set[int] = set()
    for r in v.requests.iter_pending():
        if r.group_id not in live:
            extra.add(r.group_id)
            if len(extra) >= width:
                break
    return sorted(live | extra)[:width]


@register
class FrontierDispatch(Dispatch):
    name = "frontier"

    @dataclass
    class Params:
        width: int = F(2, ge=1, help="F_w: groups in service at once per engine (the frontier holds F_w x engines)")

    def admit(self, v: Views) -> list[Submit]:
        load = {e.engine: e.assigned for e in v.engines}
        out: dict[int, list[int]] = {}
        for gid in frontier(v, self.p.width * len(v.engines)):
            reqs = [v.requests[i] for i in v.groups[gid].req_ids]
            todo = [r.req_id for r in reqs if r.state == "pending"]
            if not todo:
                continue
            serving = [r.engine for r in reqs if r.engine >= 0 and r.state in ("running", "requeueing")]
            eng = serving[0] if serving else min(load, key=lambda i: (load[i], i))
            out.setdefault(eng, []).extend(todo)
            load[eng] += len(todo)
        return [Submit(e, ids) for e, ids in sorted(out.items())]

"""FIFO dispatch: the synchronous baseline's admission (Slime / veRL style, no paper section).

Every pending request is sent at once, oldest group first, each whole group to the engine with the fewest
requests assigned, so the G samples of a group share their prompt's KV blocks on one engine. The engine's own
continuous-batching scheduler decides what runs when. Intake is the base class's synchronous rounds.
Invariant kept: a group never spans engines.
"""
from __future__ import annotations

from sched.base import Dispatch, Submit, Views, register


@register
class FifoDispatch(Dispatch):
    name = "fifo"

    def admit(self, v: Views) -> list[Submit]:
        if not v.requests.count("pending"):
            return []
        by_group: dict[int, list[int]] = {}
        for r in v.pending():
            by_group.setdefault(r.group_id, []).append(r.req_id)
        load = {e.engine: e.assigned for e in v.engines}
        out: dict[int, list[int]] = {}
        for gid in sorted(by_group):
            eng = min(load, key=lambda i: (load[i], i))
            out.setdefault(eng, []).extend(by_group[gid])
            load[eng] += len(by_group[gid])
        return [Submit(e, ids) for e, ids in sorted(out.items())]

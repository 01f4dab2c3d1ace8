"""Strict staleness control, hand-off half (pairs with the `areal` dispatch): batches of exactly `batch`
materialised groups, oldest version first, never leaving behind more old groups than later steps can still
train within the bound.

A group's version is the engine version its members started under (whole groups start together). At trainer
version w, let open(<= u) be the started, unconsumed groups of version <= u. They must all be trained by version
u + eta, i.e. within the batches of w .. u + eta, so after this batch at most (u + eta - w) x batch may remain,
for every u. The batch is the `batch` oldest materialised groups (by version, then materialisation order), which
takes the most old groups possible; if it still leaves too many behind, the trainer waits for them. The
dispatch's cap makes the wait finite: once every group of version <= u has materialised, the oldest `batch`
satisfy every u. This is the strict regime's cost the StaleFlow paper points at: training waits for the slowest
of the oldest groups.

Invariant kept: every group trained at version w has version >= w - eta (staleness <= eta).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from config import F
from sched.base import GroupState, Handoff, Views, register


def group_version(v: Views, g: GroupState) -> int:
    vs = [v.requests[i].v_traj for i in g.req_ids if i in v.requests and v.requests[i].v_traj >= 0]
    return min(vs) if vs else g.version


@register
class ArealHandoff(Handoff):
    name = "areal"

    @dataclass
    class Params:
        eta: int = F(3, ge=0, help="staleness bound (the same eta as the dispatch's)")

    def staleness_bound(self) -> int | None:
        return int(self.p.eta)

    def ready(self, v: Views) -> list[int] | None:
        B, w, eta = int(v.params["prompts_per_step"]), v.trainer.version, int(self.p.eta)
        count: Counter[int] = Counter()
        done = []
        for g in v.open_groups():
            if any(v.requests[i].v_traj < 0 for i in g.req_ids if i in v.requests):
                continue                                   # not started yet
            ver = group_version(v, g)
            count[ver] += 1
            if g.materialized:
                done.append((ver, g.materialized_seq, g.group_id))
        done.sort()
        if len(done) < B:
            return None
        batch = done[:B]
        taken = Counter(ver for ver, *_ in batch)
        left = 0
        for u in sorted(count):
            left += count[u] - taken[u]
            if left > (u + eta - w) * B:
                return None                                # would strand version-u groups: wait for them
        return [gid for *_, gid in batch]

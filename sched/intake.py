"""Intake shared by the continuous-admission dispatches (areal, lag_cap, pacing, adaptive_concurrency), and the
version-lag admission shared by lag_cap and adaptive_concurrency."""
from __future__ import annotations

import math

from sched.decisions import Submit
from sched.views import S, Views, least_loaded


class OneBatchAhead:
    """A dispatch's intake for continuous admission: pull a batch (`prompts_per_step` prompts) whenever fewer than a
    batch of pulled prompts wait to be admitted, so one batch always waits. The dispatch counts `pulled` (here) and
    `admitted` (in its admit), both cumulative; mixed in before `Dispatch`."""
    pulled: int = 0
    admitted: int = 0

    def intake(self, v: Views) -> int:
        B = v.prompts_per_step
        if self.pulled - self.admitted >= B:
            return 0
        self.pulled += B
        return B


def admit_within_lag(v: Views, admitted: int, lag: int, room: float = math.inf) -> tuple[list[Submit], int, int]:
    """The lag_cap rule (sched/policies/lag_cap.py): pending groups, oldest first, whole, each to the ready engine
    with the fewest requests among those at a version u where groups started < (lag + u + 1) x batch; a group whose
    requests came back pending (interrupted, with tokens) resumes without counting again. Stops at the first group
    no engine may take, or that would put more than `room` requests in flight. Returns the submissions, the
    cumulative count of groups started and the requests placed."""
    ready = [e for e in v.engines if e.version >= 0 and not e.loading and not e.lent and not e.failed]
    if not ready or not v.requests.count(S.PENDING):
        return [], admitted, 0
    B = v.prompts_per_step
    load = {e.engine: e.assigned for e in ready}
    out: dict[int, list[int]] = {}
    placed = 0
    for gid, ids in v.pending_by_group().items():
        fresh = len(ids) == v.groups[gid].size and all(v.requests[i].partial is None for i in ids)
        ok = {e.engine: load[e.engine] for e in ready if not fresh or admitted < (lag + e.version + 1) * B}
        if not ok or placed + len(ids) > room:
            break
        eng = least_loaded(ok)
        out.setdefault(eng, []).extend(ids)
        load[eng] += len(ids)
        placed += len(ids)
        admitted += int(fresh)
    return [Submit(e, ids) for e, ids in sorted(out.items())], admitted, placed

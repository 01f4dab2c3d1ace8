"""StaleFlow's staleness-manager Abort (§4.3, Fig. 8b-c; §5.1, footnote 2): redundant rollout and filtering.

"The staleness manager may directly issue Abort commands to rollout instances to irrevocably discard a trajectory":
an aborted trajectory is dropped for good (Abort with requeue=False), never returned to the TS. Four sources, all
off by default, as in the paper's main experiments (App. C: redundancy "introduces a noticeable distribution shift
in the generated length"):

    batch_redundancy   every buffer has ceil(r x batch) spare entries (Fig. 8b, "expanding the number of buffer
                       entries"); once `batch` of them are occupied the buffer is Ready and its reserved entries are
                       surplus (buffers.py `surplus`): their groups are aborted
    group_redundancy   every group samples G + ceil(r x G) trajectories ("increasing the number of trajectories per
                       entry"); the first G to finish are kept and the rest aborted, so the group materialises with G
    filter_uniform     a group whose rewards are all equal is filtered when it is occupied (Fig. 8c, "identical
                       rewards within a group provide no learning signal"): its entry is removed, later occupied
                       entries move forward into the hole, and its samples are discarded
    stuck_filter_s     the next buffer's reserved entries are filtered once it has been Stuck that long (Fig. 8c,
                       "when training is stalled waiting for excessively delayed trajectories")

App. C's example, ratio 1/16 with batch 128 and G = 16: 136 groups per step, or 17 trajectories per group.

Invariant kept: an aborted group has no entry in any buffer (it was dropped before its Abort), so nothing of it is
ever consumed; a group kept by group redundancy trains exactly its first G finishers; routing never places a member
of a group being dropped (the TS skips `dropping`).
"""
from __future__ import annotations

import math
from typing import Any

from sched.decisions import Abort
from sched.policies.staleflow.buffers import STUCK, StalenessBuffers
from sched.views import ABORTABLE, GroupState, RequestState, Views


def spare(n: int, ratio: float) -> int:
    """ceil(ratio x n), the redundant entries or trajectories beyond n (App. C: 128 x 1/16 = 8)."""
    return math.ceil(n * ratio - 1e-9) if ratio > 0 else 0


class StalenessAborts:
    def __init__(self, batch_redundancy: float, group_redundancy: float, filter_uniform: bool,
                 stuck_filter_s: float):
        self.batch_r, self.group_r = batch_redundancy, group_redundancy
        self.filter_uniform, self.stuck_filter_s = filter_uniform, stuck_filter_s
        self.dropping: set[int] = set()           # groups without an entry any more whose samples are to be aborted
        self.kept: dict[int, list[int]] = {}      # group -> its first finishers (group redundancy)
        self.settled: set[int] = set()            # groups whose G-th finisher arrived (their surplus aborted)
        self.cursors: dict[int, int] = {}         # round -> its finishes read so far
        self.stuck_at: tuple[int, float] | None = None   # (buffer, since when) the next buffer has been Stuck
        self.victims: list[int] = []              # surplus samples decided by `race`, to abort at the next plan
        self.counts = {"surplus_groups": 0, "surplus_samples": 0, "filtered_uniform": 0, "filtered_stuck": 0}

    @property
    def on(self) -> bool:
        return bool(self.batch_r or self.group_r or self.filter_uniform or self.stuck_filter_s)

    def group_size(self, G: int) -> int:
        return G + spare(G, self.group_r)

    # ------------------------------------------------------------------------- from the staleness buffers
    def occupied(self, sb: StalenessBuffers, g: GroupState, v: Views) -> None:
        """Group g was just occupied: filter it if the rewards it will train on (its first G finishers', under
        group redundancy: the surplus may have been scored too before its Abort) are all equal."""
        kept = self.kept.get(g.group_id)
        trajs = g.trajectories
        if kept is not None:
            samples = {v.requests[i].sample_index for i in kept}
            trajs = [t for t in trajs if t.sample_index in samples]
        if self.filter_uniform and len(trajs) >= 2 and len({t.reward for t in trajs}) == 1:
            sb.remove(g.group_id)
            self.drop(g.group_id, "filtered_uniform")

    def take_surplus(self, sb: StalenessBuffers) -> None:
        for key in sb.surplus:
            self.drop(key, "surplus_groups")
        sb.surplus.clear()

    def drop(self, key: int, why: str) -> None:
        self.dropping.add(key)
        self.counts[why] += 1

    # ------------------------------------------------------------------------------------- the decisions
    def plan(self, v: Views, sb: StalenessBuffers) -> list[Abort]:
        """The Aborts due now: dropped groups' samples, and the trajectories beyond each group's first G."""
        victims, self.victims = self.victims, []
        if self.stuck_filter_s:
            self._stuck(v, sb)
        for gid in sorted(self.dropping):
            g = v.groups.get(gid)
            if g is None or g.closed:
                self.dropping.discard(gid)
                continue
            victims += [i for i in g.req_ids if v.requests[i].state in ABORTABLE]
        by_engine: dict[int, list[int]] = {}
        for i in dict.fromkeys(victims):    # once each (a surplus sample of a group also being dropped)
            by_engine.setdefault(v.requests[i].engine, []).append(i)
        return [Abort(e, ids) for e, ids in sorted(by_engine.items())]

    def race(self, v: Views) -> None:
        """Group redundancy: keep each group's first G finishers; once the G-th arrives, the rest are victims (run
        before the buffers occupy anything, so the filter sees the kept samples)."""
        if not self.group_r:
            return
        G, out = v.group_size, self.victims
        for r, fin in v.finishes.items():
            start = self.cursors.get(r, 0)
            self.cursors[r] = len(fin)
            for rid in fin[start:]:
                q = v.requests.get(rid)
                if q is None or q.state != RequestState.FINISHED or q.group_id in self.settled:
                    continue             # a discarded finish (aborted first), or its group already has G
                g = v.groups[q.group_id]
                if g.size <= G:
                    continue
                kept = self.kept.setdefault(g.group_id, [])
                kept.append(rid)
                if len(kept) == G:
                    self.settled.add(g.group_id)
                    keep = set(kept)
                    surplus = [i for i in g.req_ids if i not in keep and v.requests[i].state in ABORTABLE]
                    self.counts["surplus_samples"] += len(surplus)
                    out += surplus
        if len(self.cursors) > len(v.finishes):          # rounds forgotten by the controller
            self.cursors = {r: c for r, c in self.cursors.items() if r in v.finishes}
            self.kept = {k: x for k, x in self.kept.items() if k in v.groups}
            self.settled = {k for k in self.settled if k in v.groups}

    def _stuck(self, v: Views, sb: StalenessBuffers) -> None:
        b = sb.v_next
        if sb.state(b) != STUCK:
            self.stuck_at = None
            return
        if self.stuck_at is None or self.stuck_at[0] != b:
            self.stuck_at = (b, v.now)
            return
        if v.now - self.stuck_at[1] < self.stuck_filter_s:
            return
        for e in [e for e in sb.slots(b) if e is not None and not e.occupied]:
            sb.remove(e.key)
            self.drop(e.key, "filtered_stuck")
        self.take_surplus(sb)
        self.stuck_at = None

    def state_dict(self) -> dict[str, Any]:
        return {"dropping": sorted(self.dropping)} if self.dropping else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dropping = set(state.get("dropping", ()))

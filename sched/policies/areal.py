"""Strict staleness control (configs/sched/areal.toml): AReaL / VeRL-Async / ROLL Flash as StaleFlow §2.2 and §6.1
describe them, the baseline StaleFlow and Laminar compare against.

    areal  dispatch     admission capped so that at most (eta + 1) x batch groups are in flight
    areal  handoff      batches of `batch` groups, oldest version first, never stranding an old group
    areal  weight_sync  every engine adopts each published version at once, running sequences recomputing their KV

The staleness bound eta is the dispatch's parameter; the hand-off takes it from there (one design, one eta).
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import Dispatch, Handoff, Preset, WeightSync, register
from sched.decisions import LoadWeights, Submit
from sched.intake import OneBatchAhead
from sched.views import ON_ENGINE, GroupState, Request, S, Views, least_loaded


@register
class ArealDispatch(OneBatchAhead, Dispatch):
    """"The total amount of in-flight data (i.e., trajectories that are either being generated or have been
    generated but not yet consumed)" is capped so that no sample can be staler than eta. AReaL's form of the cap,
    in groups: a group may start on an engine holding version u only while

        groups admitted so far (cumulative) < (eta + u + 1) x batch

    so at most (eta + 1) x batch groups are ever in flight and at most (eta + u + 1) x batch groups of version <= u
    exist: by the time the trainer reaches version u + eta, all but one batch of them are consumed (the `areal`
    hand-off then takes those first). Whole groups go to the engine with the fewest requests (fixed assignment: no
    migration; weights change under them in place). Intake keeps one batch of prompts waiting.

    Concurrency cap: AReaL's `max_concurrent_rollouts` ("Maximum number of concurrent rollouts to the inference
    engine. Defaults to consumer_batch_size"): its executor admits a rollout only while fewer than
    `max(1, max_concurrent_rollouts // world_size)` run per shard. A rollout there is one prompt's workflow (one
    GROUP) and consumer_batch_size is the training batch in groups, so the cap counts groups and 0 means AReaL's
    default, one training batch. Without it the (eta + 1) x batch bound alone lands every admitted group on the
    engines at once, a thrash no AReaL deployment runs. verl's fully async rollouter caps per server instead
    (`per_engine`, configs/sched/verl_async.toml). The StaleFlow paper does not report the baselines' value.

    Invariants kept: admitted groups never outnumber (eta + u + 1) x batch for the engine version u they start
    under; no engine is given a group while `per_engine` (or `max(1, max_concurrent_rollouts // engines)`) groups
    are live on it."""
    name = "areal"
    paper = "AReaL / VeRL-Async strict staleness control, as StaleFlow §2.2, §6.1 describe it"

    @dataclass
    class Params:
        eta: int = F(3, ge=0, help="staleness bound: trainer version - generating version at consumption")
        max_concurrent_rollouts: int = F(0, ge=0, help="groups generating at once over all engines, spread "
                                         "evenly per engine (AReaL's knob; 0: its default, one training batch)")
        per_engine: int = F(0, ge=0, help="groups generating at once per engine, instead of max_concurrent_rollouts "
                            "(verl's fully async rollouter: 16 per server; 0: use max_concurrent_rollouts)")

    def __init__(self, params: "ArealDispatch.Params | None" = None):
        super().__init__(params)
        self.admitted = 0      # groups started, cumulative
        self.pulled = 0        # groups pulled into the pipeline, cumulative
        # `_live_groups`' books: engine -> group -> its members placed there and not yet seen leaving; per engine
        # how many members that is; per round, how far its finishes (Views.finishes) were read
        self.live: dict[int, dict[int, dict[int, Request]]] = {}
        self.members: Counter[int] = Counter()
        self.cursor: dict[int, int] = {}
        self.finished = 0      # Views.finished when the cursors were last read
        self.synced = False
        self.own_placement = False

    def staleness_bound(self) -> int | None:
        return self.p.eta

    def bind(self, preset: Preset) -> None:
        # only this dispatch puts requests on engines unless the rebalance can migrate them (`_live_groups`)
        self.own_placement = preset.rebalance.name == "none"

    def admit(self, v: Views) -> list[Submit]:
        B = v.prompts_per_step
        ready = [e for e in v.engines if e.version >= 0 and not e.loading]
        if not ready or self.admitted >= (self.p.eta + max(e.version for e in ready) + 1) * B:
            return []
        if not v.requests.count(S.PENDING):
            return []
        cap = self.p.per_engine or max(1, (self.p.max_concurrent_rollouts or B) // max(1, len(v.engines)))
        groups = self._live_groups(v)
        if all(groups[e.engine] >= cap for e in ready):
            return []
        load = {e.engine: e.assigned for e in ready}
        out: dict[int, list[int]] = {}
        for gid, members in itertools.groupby(v.requests.iter_pending(), key=lambda r: r.group_id):
            ok = {e.engine: load[e.engine] for e in ready
                  if self.admitted < (self.p.eta + e.version + 1) * B and groups[e.engine] < cap}
            if not ok:
                break
            rs = list(members)
            ids = [r.req_id for r in rs]
            eng = least_loaded(ok)
            out.setdefault(eng, []).extend(ids)
            books = self.live.setdefault(eng, {}).setdefault(gid, {})
            self.members[eng] += sum(1 for r in rs if r.req_id not in books)
            books.update((r.req_id, r) for r in rs)
            load[eng] += len(ids)
            groups[eng] += 1
            self.admitted += 1
        return [Submit(e, ids) for e, ids in sorted(out.items())]

    def _live_groups(self, v: Views) -> dict[int, int]:
        """Per engine, the groups with a request on it (AReaL's running rollouts), exactly, at a cost per event of
        the requests that finished since the last call. Kept from this dispatch's own Submits (`live`); the
        controller's list of finishes (`Views.finishes`, read from a cursor per round) takes members off one by
        one. An engine whose count of members then differs from its `assigned` (a member left another way: an
        interrupt, an abort, a round forgotten before its finishes were read) is recounted from its members'
        states. Rebuilt from the running index after a resume, and on every call when a rebalance may migrate
        requests onto other engines."""
        if not self.synced or not self.own_placement:
            self.live, self.members = {}, Counter()
            for r in v.requests.in_state(*ON_ENGINE):
                self.live.setdefault(r.engine, {}).setdefault(r.group_id, {})[r.req_id] = r
                self.members[r.engine] += 1
            self.cursor = {rnd: len(done) for rnd, done in v.finishes.items()}
            self.finished, self.synced = v.finished, True
        elif v.finished != self.finished:    # finishes arrived since the last call
            self.finished = v.finished
            for rnd, done in v.finishes.items():
                k = self.cursor.get(rnd, 0)
                if k == len(done):
                    continue
                for rid in done[k:]:
                    r = v.requests.get(rid)
                    group = self.live.get(r.engine, {}).get(r.group_id) if r is not None else None
                    if group is not None and group.pop(rid, None) is not None:
                        self.members[r.engine] -= 1
                        if not group:
                            del self.live[r.engine][r.group_id]
                self.cursor[rnd] = len(done)
            if len(self.cursor) > len(v.finishes):
                self.cursor = {rnd: k for rnd, k in self.cursor.items() if rnd in v.finishes}
        out = {}
        live, counts = self.live, self.members
        for e in v.engines:
            groups = live.get(e.engine)
            if counts[e.engine] != e.assigned:
                groups = groups or {}
                for gid in list(groups):
                    members = groups[gid]
                    for rid in [rid for rid, r in members.items() if r.state not in ON_ENGINE or r.engine != e.engine]:
                        del members[rid]
                    if not members:
                        del groups[gid]
                counts[e.engine] = sum(len(m) for m in groups.values())
            out[e.engine] = len(groups) if groups else 0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "pulled": self.pulled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.admitted, self.pulled = int(state.get("admitted", 0)), int(state.get("pulled", 0))
        self.synced = False


def group_version(v: Views, g: GroupState) -> int:
    """The engine version a group's members started under (whole groups start together)."""
    vs = [v.requests[i].v_traj for i in g.req_ids if i in v.requests and v.requests[i].v_traj >= 0]
    return min(vs) if vs else g.version


@register
class ArealHandoff(Handoff):
    """Batches of exactly `batch` materialised groups, oldest version first, never leaving behind more old groups
    than later steps can still train within the bound. At trainer version w, let open(<= u) be the started,
    unconsumed groups of version <= u: they must all be trained by version u + eta, i.e. within the batches of
    w .. u + eta, so after this batch at most (u + eta - w) x batch may remain, for every u. The batch is the
    `batch` oldest materialised groups (by version, then materialisation order); if it still leaves too many behind,
    the trainer waits for them. The dispatch's cap makes the wait finite. This is the strict regime's cost the
    StaleFlow paper points at: training waits for the slowest of the oldest groups.

    Invariant kept: every group trained at version w has version >= w - eta (staleness <= eta), eta being the
    `areal` dispatch's."""
    name = "areal"
    paper = "AReaL / VeRL-Async strict staleness control, as StaleFlow §2.2, §6.1 describe it"

    def __init__(self, params: Any = None):
        super().__init__(params)
        self.versions: dict[int, int] = {}   # open started group -> its version (fixed once every member started)
        self.waited: tuple | None = None     # `ready`'s inputs when it last answered "wait for stragglers"

    def bind(self, preset: Preset) -> None:
        if not isinstance(preset.dispatch, ArealDispatch):
            raise ValueError(f"the areal handoff takes its staleness bound from the areal dispatch; this preset's "
                             f"dispatch is {preset.dispatch.name!r}")
        self.dispatch = preset.dispatch

    def ready(self, v: Views) -> list[int] | None:
        B, w, eta = v.prompts_per_step, v.trainer.version, self.dispatch.p.eta
        if v.groups.count_ready() < B:
            return None                                    # no batch can form (a shortcut: decisions unchanged)
        # what the answer depends on: materialised / dropped / consumed groups, started groups, the trainer version
        key = (v.materialized, v.dropped, v.trainer.groups_consumed, self.dispatch.admitted, w)
        if key == self.waited:
            return None                                    # nothing changed since it last said wait
        count: Counter[int] = Counter()
        done = []
        for g in v.open_groups():
            ver = self.versions.get(g.group_id)
            if ver is None:
                if any(v.requests[i].v_traj < 0 for i in g.req_ids if i in v.requests):
                    continue                               # not started yet
                ver = self.versions[g.group_id] = group_version(v, g)
            count[ver] += 1
            if g.materialized:
                done.append((ver, g.materialized_seq, g.group_id))
        done.sort()
        if len(done) < B:
            return None
        batch = done[:B]
        taken, left = Counter(ver for ver, *_ in batch), 0
        for u in sorted(count):
            left += count[u] - taken[u]
            if left > (u + eta - w) * B:
                self.waited = key
                return None                                # would strand version-u groups: wait for them
        for *_, gid in batch:
            del self.versions[gid]
        return [gid for *_, gid in batch]

    def batch_groups(self, prompts_per_step: int) -> int | None:
        return prompts_per_step

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.versions.clear()                              # resumed requests are first admitted again
        self.waited = None


@register
class ArealSync(WeightSync):
    """Global version sync with partial rollout: every engine adopts each published version as soon as it appears,
    busy or not; its running sequences keep their tokens and continue under the new weights after their KV is
    discarded and recomputed (AReaL v0.3's interrupt; LoadWeights.keep_kv False). No trajectory store, no migration.

    Invariant kept: engines move only to published, newer versions; a trajectory's oldest token version is the
    version it started under, which is what the `areal` dispatch and hand-off bound."""
    name = "areal"
    paper = "AReaL / VeRL-Async global weight sync with in-place partial rollout"

    def engines_to_load(self, v: Views) -> list[LoadWeights]:
        ps = v.trainer.published
        return [LoadWeights(e.engine, ps) for e in v.engines if e.version < ps and not e.loading]

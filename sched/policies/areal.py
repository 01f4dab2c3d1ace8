"""Strict staleness control (configs/sched/areal.toml): AReaL / VeRL-Async / ROLL Flash as StaleFlow §2.2 and §6.1
describe them, the baseline StaleFlow and Laminar compare against.

    areal  dispatch     admission capped so that at most (eta + 1) x batch groups are in flight
    areal  handoff      batches of `batch` groups, oldest version first, never stranding an old group
    areal  weight_sync  every engine adopts each published version at once, running sequences continuing in place

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
from sched.views import ON_ENGINE, GroupState, S, Views, least_loaded


@register
class ArealDispatch(Dispatch):
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
        self.placed: dict[int, dict[int, list[int]]] = {}   # `_live_groups`' books
        self.counted: dict[int, tuple[int, int]] = {}        # engine -> (its `assigned`, live groups) when counted
        self.synced = False
        self.own_placement = False

    def staleness_bound(self) -> int | None:
        return self.p.eta

    def intake(self, v: Views) -> int:
        B = v.prompts_per_step
        if self.pulled - self.admitted >= B:
            return 0
        self.pulled += B
        return B

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
            ids = [r.req_id for r in members]
            eng = least_loaded(ok)
            out.setdefault(eng, []).extend(ids)
            self.placed.setdefault(eng, {}).setdefault(gid, []).extend(ids)
            self.counted.pop(eng, None)
            load[eng] += len(ids)
            groups[eng] += 1
            self.admitted += 1
        return [Submit(e, ids) for e, ids in sorted(out.items())]

    def _live_groups(self, v: Views) -> dict[int, int]:
        """Per engine, the groups with a request on it (AReaL's running rollouts). Kept incrementally from this
        dispatch's own Submits (`placed`: engine -> group -> its ids that may still be there, the last checked
        first, so each request is passed over once after it leaves) and re-counted only on an engine whose
        `assigned` moved since (a request left, or this dispatch placed one); rebuilt from the running index
        after a resume, and on every call when a rebalance may migrate requests onto other engines."""
        if not self.synced or not self.own_placement:
            self.placed, self.counted = {}, {}
            for r in v.requests.in_state(*ON_ENGINE):
                self.placed.setdefault(r.engine, {}).setdefault(r.group_id, []).append(r.req_id)
            self.synced = True
        out = {}
        for e in v.engines:
            eng = e.engine
            seen = self.counted.get(eng)
            if seen is not None and seen[0] == e.assigned:
                out[eng] = seen[1]
                continue
            groups = self.placed.get(eng, {})
            for gid in list(groups):
                ids = groups[gid]
                while ids and not _on(v, ids[-1], eng):
                    ids.pop()
                if not ids:
                    del groups[gid]
            out[eng] = len(groups)
            self.counted[eng] = (e.assigned, len(groups))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "pulled": self.pulled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.admitted, self.pulled = int(state.get("admitted", 0)), int(state.get("pulled", 0))
        self.synced = False


def _on(v: Views, req_id: int, engine: int) -> bool:
    r = v.requests.get(req_id)
    return r is not None and r.state in ON_ENGINE and r.engine == engine


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
        taken = Counter(ver for ver, *_ in batch)
        left = 0
        for u in sorted(count):
            left += count[u] - taken[u]
            if left > (u + eta - w) * B:
                self.waited = key
                return None                                # would strand version-u groups: wait for them
        for *_, gid in batch:
            del self.versions[gid]
        return [gid for *_, gid in batch]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.versions.clear()                              # resumed requests are first admitted again
        self.waited = None


@register
class ArealSync(WeightSync):
    """Global version sync with partial rollout: every engine adopts each published version as soon as it appears,
    busy or not; its running sequences keep their tokens and continue under the new weights after a KV recompute
    (the engine's in-place load). No interrupt to a trajectory store, no migration.

    Invariant kept: engines move only to published, newer versions; a trajectory's oldest token version is the
    version it started under, which is what the `areal` dispatch and hand-off bound."""
    name = "areal"
    paper = "AReaL / VeRL-Async global weight sync with in-place partial rollout"

    def engines_to_load(self, v: Views) -> list[LoadWeights]:
        ps = v.trainer.published
        return [LoadWeights(e.engine, ps) for e in v.engines if e.version < ps and not e.loading]

"""Per-engine batches: Laminar's dispatch, §3.2 steps 1-3 and §5-§6."""
from __future__ import annotations

import math
from dataclasses import dataclass

from config import F
from sched.base import Dispatch, register
from sched.decisions import Submit
from sched.resources import EngineView
from sched.views import Views, least_loaded


@register
class LaminarDispatch(Dispatch):
    """Each engine ("rollout") generates its own batch on one weight version, independently of the trainer and of
    the other engines: as soon as an engine holds nothing (its batch finished, or released by a repack), holds the
    latest published version (`pull_latest` loads it first) and has no repacked trajectories on their way to it,
    it takes a fresh batch of `batch_groups` prompts from the prompt pool, whole GRPO groups (all G samples of a
    prompt on that engine, so a group shares one version and its prompt's KV blocks). The paper's per-rollout
    "maximum concurrency ... 1024 trajectories" (App. A.3) is `batch_groups` x G; 0 divides the run's
    prompts_per_step evenly over the engines. The trainer never gates intake; `max_backlog` (groups generated or
    generating but not yet trained; 0 = unbounded, as in the paper's throughput runs) is the optional
    back-pressure of §7/§10 ("rollouts can out-produce the trainer"; the paper leaves capacity and eviction open).

    In controller terms a "round" is the set of batches started at one decision: bookkeeping here, never a
    synchronisation point. A request handed back without a destination (none in Laminar's own mechanisms) goes to
    the least-loaded engine whose version is not older than its tokens.

    Invariant kept: an engine never starts a batch while it holds a trajectory or before it adopted the latest
    published version; a group never spans engines at admission."""
    name = "laminar"
    paper = "Laminar §3.2 steps 1-3, §5-§6 (trajectory-level asynchrony)"

    @dataclass
    class Params:
        batch_groups: int = F(0, ge=0, help="groups per engine batch (0: ceil(prompts_per_step / engines))")
        max_backlog: int = F(0, ge=0, help="most groups generated-or-generating but untrained (0: no bound)")

    def __init__(self, params: "LaminarDispatch.Params | None" = None):
        super().__init__(params)
        self.todo: dict[int, int] = {}   # engine -> groups of its new batch not yet admitted

    def batch(self, v: Views) -> int:
        return self.p.batch_groups or math.ceil(v.prompts_per_step / max(1, len(v.engines)))

    def can_start_batch(self, v: Views, e: EngineView) -> bool:
        return (e.assigned == 0 and not e.loading and e.version >= 0 and e.version >= v.trainer.published
                and e.engine not in self.todo and not v.migrating_to(e.engine))

    def intake(self, v: Views) -> int:
        ready = [e.engine for e in v.engines if self.can_start_batch(v, e)]
        if not ready:
            return 0
        k = self.batch(v)
        room = math.inf
        if self.p.max_backlog:
            room = self.p.max_backlog - len(v.open_groups())
        n = 0
        for eng in ready:
            if room < k:
                break
            self.todo[eng] = k
            room -= k
            n += k
        return n

    def admit(self, v: Views) -> list[Submit]:
        out: dict[int, list[int]] = {}
        for ids in v.pending_by_group().values():
            resumed = [p for i in ids if (p := v.requests[i].partial) is not None]
            if resumed:             # handed back without a destination: any engine not older than its tokens
                need = max((max(p.versions, default=-1) for p in resumed), default=-1)
                ok = {e.engine: e.assigned for e in v.engines if e.version >= max(need, 0) and not e.loading}
                if ok:
                    out.setdefault(least_loaded(ok), []).extend(ids)
                continue
            eng = next((e for e, k in sorted(self.todo.items()) if k > 0), None)
            if eng is None:
                continue
            out.setdefault(eng, []).extend(ids)
            self.todo[eng] -= 1
            if self.todo[eng] == 0:
                del self.todo[eng]
        self.todo.clear()           # a batch short of prompts starts short rather than blocking its engine
        return [Submit(e, ids) for e, ids in sorted(out.items())]

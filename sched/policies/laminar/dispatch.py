"""Per-engine batches: Laminar's dispatch, §3.2 steps 1-3 and §5-§6."""
from __future__ import annotations

import math
from dataclasses import dataclass

from config import F
from sched.base import Dispatch, register
from sched.decisions import Submit
from sched.resources import EngineView
from sched.views import Request, Views, least_loaded


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
    synchronisation point. A request handed back without a destination (a failed engine's, §3.3) resumes on the
    least-loaded healthy engine of the SAME version as its tokens (or, with none yet, of the engine it started on);
    while a failed engine of that version may still rejoin, it waits for it ("or wait for a replacement that loads
    exactly that version"); with neither, it goes to the least-loaded engine not older than its tokens, a
    two-version trajectory (our assumption: the paper's replacement loads the old version from actor checkpoint
    files, which the relays, holding only the newest, cannot).

    Invariant kept: an engine never starts a batch while it holds a trajectory or before it adopted the latest
    published version, nor takes work while failed; a group never spans engines at admission."""
    name = "laminar"
    paper = "Laminar §3.2 steps 1-3, §3.3, §5-§6 (trajectory-level asynchrony)"
    skips_failed_engines = True

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
        return (e.assigned == 0 and not e.loading and not e.failed and e.version >= 0
                and e.version >= v.trainer.published and e.engine not in self.todo and not v.migrating_to(e.engine))

    def intake(self, v: Views) -> int:
        ready = [e.engine for e in v.engines if e.assigned == 0 and self.can_start_batch(v, e)]
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
        pending = v.pending_by_group()
        if not pending:             # the common case: called on every event
            self.todo.clear()
            return []
        out: dict[int, list[int]] = {}
        for ids in pending.values():
            back = [i for i in ids if v.requests[i].partial is not None or v.requests[i].v_traj >= 0]
            if back:                # handed back without a destination: resumed one by one (class docstring)
                for i in back:
                    eng = self.resume_on(v, v.requests[i])
                    if eng is not None:
                        out.setdefault(eng, []).append(i)
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

    @staticmethod
    def resume_on(v: Views, r: Request) -> int | None:
        """The engine a handed-back request resumes on (None: wait), by the rule in the class docstring."""
        part = r.partial
        need = max(part.versions) if part is not None and part.versions else r.v_traj
        healthy = [e for e in v.engines if not e.failed and not e.loading and e.version >= max(need, 0)]
        same = {e.engine: e.assigned for e in healthy if e.version == need}
        if same:
            return least_loaded(same)
        if any(e.failed and not e.retired and e.version == need for e in v.engines):
            return None
        return least_loaded({e.engine: e.assigned for e in healthy}) if healthy else None

"""Strict staleness control, admission half (AReaL / VeRL-Async / ROLL Flash as StaleFlow §2.2 and §6.1
describe them; the simulator model of seeds_staleflow.md §4 [inferred]).

"The total amount of in-flight data (i.e., trajectories that are either being generated or have been generated
but not yet consumed)" is capped so that no sample can be staler than eta. We use AReaL's form of the cap, in
groups: a group may start on an engine holding version u only while

    groups admitted so far (cumulative) < (eta + u + 1) x batch

so at most (eta + 1) x batch groups are ever in flight and at most (eta + u + 1) x batch groups of version <= u
exist: by the time the trainer reaches version u + eta, all but one batch of them are consumed (the `areal`
hand-off then takes those first). Whole groups go to the engine with the fewest requests (fixed assignment: no
migration; weights change under them in place, `areal` weight sync). Intake keeps one batch of prompts waiting.

Concurrency cap (AReaL's `InferenceEngineConfig.max_concurrent_rollouts`, "Maximum number of concurrent rollouts
to the inference engine. Defaults to consumer_batch_size"; its executor admits a rollout only while
`len(rollout_tasks) < max(1, max_concurrent_rollouts // world_size)`). A rollout task there is one prompt's
workflow, i.e. one GROUP, and consumer_batch_size is the training batch in groups; so `max_concurrent_rollouts`
counts groups and 0 means AReaL's default, one training batch (`prompts_per_step`). It is spread over the
engines as AReaL spreads it over its shards: an engine takes another group only while fewer than
`max(1, max_concurrent_rollouts // engines)` groups have a member running on it. Without it the (eta + 1) x batch
in-flight bound alone lands every admitted group on the engines at once (thousands of sequences on 64 instances,
preempting each other: a thrash no AReaL deployment runs). The default is AReaL's own, not fitted to any figure;
the StaleFlow paper does not report the baselines' value (seeds_staleflow.md §4 [inferred] baseline model).

Invariants kept: admitted groups never outnumber (eta + u + 1) x batch for the engine version u they start under;
no engine is given a group while `max(1, max_concurrent_rollouts // engines)` groups are live on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import Dispatch, Submit, Views, register


@register
class ArealDispatch(Dispatch):
    name = "areal"

    @dataclass
    class Params:
        eta: int = F(3, ge=0, help="staleness bound: trainer version - generating version at consumption")
        max_concurrent_rollouts: int = F(0, ge=0, help="groups generating at once over all engines, spread "
                                         "evenly per engine (AReaL's knob; 0: its default, one training batch)")

    def __init__(self, params: "ArealDispatch.Params | None" = None):
        super().__init__(params)
        self.admitted = 0      # groups started, cumulative
        self.pulled = 0        # groups pulled into the pipeline, cumulative

    def staleness_bound(self) -> int | None:
        return int(self.p.eta)

    def intake(self, v: Views) -> int:
        B = int(v.params["prompts_per_step"])
        if self.pulled - self.admitted >= B:
            return 0
        self.pulled += B
        return B

    def admit(self, v: Views) -> list[Submit]:
        B = int(v.params["prompts_per_step"])
        ready = [e for e in v.engines if e.version >= 0 and not e.loading]
        if not ready or self.admitted >= (self.p.eta + max(e.version for e in ready) + 1) * B:
            return []
        by_group: dict[int, list[int]] = {}
        for r in v.pending():
            by_group.setdefault(r.group_id, []).append(r.req_id)
        load = {e.engine: e.assigned for e in ready}
        cap = max(1, (self.p.max_concurrent_rollouts or B) // max(1, len(v.engines)))
        live: dict[int, set[int]] = {e.engine: set() for e in v.engines}
        for r in v.requests.in_state("running", "interrupting", "aborting", "requeueing"):
            if r.engine in live:
                live[r.engine].add(r.group_id)
        groups = {e: len(gs) for e, gs in live.items()}
        out: dict[int, list[int]] = {}
        for gid in sorted(by_group):
            ok = [e for e in ready if self.admitted < (self.p.eta + e.version + 1) * B and groups[e.engine] < cap]
            if not ok:
                break
            eng = min(ok, key=lambda e: (load[e.engine], e.engine)).engine
            out.setdefault(eng, []).extend(by_group[gid])
            load[eng] += len(by_group[gid])
            groups[eng] += 1
            self.admitted += 1
        return [Submit(e, ids) for e, ids in sorted(out.items())]

    def state_dict(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "pulled": self.pulled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.admitted, self.pulled = int(state.get("admitted", 0)), int(state.get("pulled", 0))

"""APRIL, active partial rollouts (arXiv 2509.18521; slime's `--partial-rollout` with `--over-sampling-batch-size`;
configs/sched/april.toml).

    april  dispatch   each step puts N' = ceil(over_sampling x N) groups in flight: the groups carried over from the
                      last step first, then fresh prompts; places them only while the step is open
    april  rebalance  once N groups have materialised, interrupts every running request (their tokens so far come
                      back and wait, pending, for the next step)

How it differs from `partial_rollout` (sched/policies/partial_rollout.py, Kimi k1.5's partial rollouts as AReaL and
Laminar describe them): there the trigger is a weight publication in an overlapping one-step-off pipeline, and the
interrupted trajectories resume at once on the new weights while the next round is already running. APRIL keeps a
synchronous loop (generate, train, publish, generate) and changes only when a step's generation ends: it starts more
groups than the batch needs (N' > N), ends the generation phase as soon as N of them are complete, instead of
waiting for the slowest one, and carries the unfinished ones, with every token generated so far, into the next
step, whose N' slots they fill first. Nothing is discarded (slime without `--partial-rollout` aborts them and
loses the tokens). The hand-off is any buffer that takes the first N groups to materialise (`experience_buffer`,
`fifo`, N groups); engines adopt the new version once their interrupted requests are back (`pull_latest`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import Dispatch, Preset, Rebalance, register
from sched.decisions import Interrupt, Submit
from sched.views import S, Views, least_loaded


@register
class AprilDispatch(Dispatch):
    """APRIL's over-provisioning (arXiv 2509.18521; slime `slime/rollout/sglang_rollout.py`,
    `generate_rollout_async`: it submits `over_sampling_batch_size` groups per step, the buffer's aborted groups
    first, and stops once `rollout_batch_size` groups are complete).

    A step opens when the trainer is idle and every engine holds its version: N' - (groups still open) fresh prompts
    are pulled, N' = max(N, ceil(over_sampling x N)), N the run's `prompts_per_step`. Every pending request (the
    carried groups' interrupted ones first: lower group ids) goes, whole groups, to the engine at the trainer's
    version with the fewest requests; no concurrency cap beyond the engine's own batching. The step closes when N
    groups have been handed to the trainer; nothing is placed from the moment N groups are complete until the next
    step opens, so carried requests resume on the new weights.

    Invariant kept: N' groups are open when a step opens (at most N' - N are carried over); requests are placed only
    on engines at the trainer's version, only while fewer than N groups are complete; nothing is dropped."""
    name = "april"
    paper = "APRIL (arXiv 2509.18521) over-provisioning; slime --over-sampling-batch-size"

    @dataclass
    class Params:
        over_sampling: float = F(2.0, ge=1.0, help="N' / N: groups in flight per step over groups trained per step "
                                                   "(APRIL, arXiv 2509.18521; slime's --over-sampling-batch-size "
                                                   "over --rollout-batch-size, 64 / 32 in APRIL's README); 1: sync")

    def __init__(self, params: "AprilDispatch.Params | None" = None):
        super().__init__(params)
        self.until = 0           # TrainerView.groups_consumed at which the open step has its batch
        self.steps = 0           # steps opened
        self.carried = 0         # groups carried into a step, summed over steps

    def provision(self, batch: int) -> int:
        """N' for a batch of N groups."""
        return max(batch, math.ceil(self.p.over_sampling * batch - 1e-9))

    def is_open(self, v: Views) -> bool:
        return v.trainer.groups_consumed < self.until

    def intake(self, v: Views) -> int:
        if self.is_open(v) or v.trainer.busy or not v.engines_at(v.trainer.version):
            return 0
        self.until = v.trainer.groups_consumed + v.prompts_per_step
        carried = len(v.open_groups())
        self.steps += 1
        self.carried += carried
        return max(0, self.provision(v.prompts_per_step) - carried)

    def admit(self, v: Views) -> list[Submit]:
        if not self.is_open(v) or not v.requests.count(S.PENDING) or v.groups.count_ready() >= v.prompts_per_step:
            return []
        load = {e.engine: e.assigned for e in v.engines
                if e.version == v.trainer.version and not e.loading and not e.lent and not e.failed}
        if not load:
            return []
        out: dict[int, list[int]] = {}
        for ids in v.pending_by_group().values():
            eng = least_loaded(load)
            out.setdefault(eng, []).extend(ids)
            load[eng] += len(ids)
        return [Submit(e, ids) for e, ids in sorted(out.items())]

    def stats(self) -> dict[str, float]:
        return {"steps": float(self.steps), "groups_carried": float(self.carried)}

    def state_dict(self) -> dict[str, Any]:
        return {"until": self.until}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.until = int(state.get("until", 0))


@register
class AprilStop(Rebalance):
    """APRIL's active interruption (arXiv 2509.18521; slime's `abort` after the rollout batch is full, which with
    `--partial-rollout` hands the unfinished groups back to the data buffer, `data_source.add_samples`): as soon as
    the hand-off holds a batch (N materialised groups, `Handoff.batch_groups`), every running request, on every
    engine, is interrupted; its tokens so far, their behaviour log-probs and per-token versions come back
    (`Request.partial`) and it waits, pending, for the next step, which re-prefills prompt + tokens so far under the
    new weights. A carried group's finished samples stay finished (slime skips completed samples on resume).

    Slime's `--mask-offpolicy-in-partial-rollout` (loss-mask the tokens of earlier versions) is not applied here:
    every token keeps its version and behaviour log-prob, and `train.off_policy` / `train.correction` decide.

    Invariant kept: only RUNNING requests are interrupted, only once N groups are complete; nothing is dropped (an
    interrupted request is pending again with every token it had)."""
    name = "april"
    paper = "APRIL (arXiv 2509.18521) active interruption; slime --partial-rollout"

    def __init__(self, params: Any = None):
        super().__init__(params)
        self.interrupts = 0
        self.batch: Any = None

    def bind(self, preset: Preset) -> None:
        self.batch = preset.handoff.batch_groups

    def plan(self, v: Views) -> list[Interrupt]:
        n = (self.batch(v.prompts_per_step) if self.batch is not None else None) or v.prompts_per_step
        if v.groups.count_ready() < n or not v.requests.count(S.RUNNING):
            return []
        by_engine: dict[int, list[int]] = {}
        for r in sorted(v.requests.in_state(S.RUNNING), key=lambda r: r.req_id):
            by_engine.setdefault(r.engine, []).append(r.req_id)
        self.interrupts += sum(len(ids) for ids in by_engine.values())
        return [Interrupt(e, ids) for e, ids in sorted(by_engine.items())]

    def stats(self) -> dict[str, float]:
        return {"interrupted": float(self.interrupts)}

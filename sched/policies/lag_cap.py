"""A version-lag admission cap with no concurrency cap: PipelineRL's `max_lag` back-pressure and TitanRL's active
buffer (configs/sched/pipelinerl.toml, configs/sched/windowed_fifo.toml).

    lag_cap  dispatch  a group starts on an engine at version u only while groups started < (lag + u + 1) x batch;
                       every group the cap allows goes to an engine at once (the engine's batching limits it)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import Dispatch, register
from sched.decisions import Submit
from sched.intake import OneBatchAhead, admit_within_lag
from sched.views import Views


@register
class LagCap(OneBatchAhead, Dispatch):
    """Admission bounded by version lag, in whole groups, and nothing else.

    PipelineRL (arXiv 2509.19128; its actor loop, `pipelinerl/actor.py`): with `max_lag` set, the actor may submit
    `lag_groups + groups_per_update` groups before the first weight update and `groups_per_update` more at each
    version it sees, so the groups started never exceed (lag + 1 + versions seen) x batch. PipelineRL counts
    `max_lag` in samples (lag_groups = ceil(max_lag / attempts)); here `lag` counts optimizer steps (versions), as
    ScaleRL's "PipelineRL-k" (arXiv 2510.13786) does. TitanRL's windowed FIFO (torchtitan
    `experiments/rl/docs/windowed_fifo.md`) caps its active buffer at B = (S + 1) x P groups, S its target
    off-policy steps: the same count with lag = S. Our reading counts the version of the engine a group starts on
    (not the trainer's), so the cap bounds what the trainer later sees in token versions:

        groups started so far (cumulative) < (lag + u + 1) x batch      u: the engine's version

    No concurrency cap ("no admission cap" beyond the lag): unlike AReaL's `max_concurrent_rollouts`, every group
    the cap allows goes, whole, to the ready engine with the fewest requests at once; the engine's continuous
    batching (its max_num_seqs and KV pool) decides what runs. PipelineRL's `llm_max_rollouts` is vLLM's
    max-num-seqs, i.e. the engine's own limit. Intake keeps one batch of prompts waiting.

    A group some of whose requests come back pending (interrupted by a rebalance, with their tokens) was counted
    when it started: its pending requests resume, together, on the ready engine with the fewest requests.

    Invariant kept: admitted groups never outnumber (lag + u + 1) x batch for the engine version u they start
    under; groups start in group-id order (oldest first), whole, on one engine."""
    name = "lag_cap"
    paper = "PipelineRL max_lag admission (arXiv 2509.19128, actor.py); TitanRL active buffer (windowed_fifo.md)"

    @dataclass
    class Params:
        lag: int = F(1, ge=0, help="versions a started group may lag: PipelineRL's max_lag (in optimizer steps), "
                                   "TitanRL's target_offpolicy_steps S; groups started < (lag + u + 1) x batch")

    def __init__(self, params: "LagCap.Params | None" = None):
        super().__init__(params)
        self.admitted = 0      # groups started, cumulative
        self.pulled = 0        # groups pulled into the pipeline, cumulative

    def admit(self, v: Views) -> list[Submit]:
        out, self.admitted, _ = admit_within_lag(v, self.admitted, self.p.lag)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "pulled": self.pulled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.admitted, self.pulled = int(state.get("admitted", 0)), int(state.get("pulled", 0))

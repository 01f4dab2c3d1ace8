"""Driving an off-policy preset through the simulator with random workloads and timings, recording what the trainer
received and checking, after every decision, properties of the controller's views (shared by test_laminar.py and
test_offpolicy_presets.py)."""
from __future__ import annotations

import random
from typing import Any, Callable

import sched
from sched.controller import Controller, PromptItem
from sched.events import EventLog
from sim.backend import SimBackend
from sim.cost import CostModel, RewardLatency, RewardTask
from sim.tokens import RunList
from sim.workload import TraceWorkload


def random_cost(rng: random.Random) -> CostModel:
    """Memory-bound decode (a step costs about the same for 1 or 40 sequences) with a small KV pool, so long-tail
    engines ramp down and repack has something to consolidate; reward latency spreads over two decades."""
    return CostModel(name="prop", k1=rng.choice([0.0, 1e-7, 1e-6]), k2=rng.uniform(5e-3, 2e-2), k3=1e-4,
                     k4=1e-3, prefill_s_per_token=rng.choice([1e-6, 1e-4]),
                     kv_capacity_tokens=16 * rng.randint(60, 200), train_s_per_token=rng.uniform(1e-5, 1e-3),
                     publish_s=rng.uniform(0.01, 2.0), load_s=rng.uniform(0.01, 0.5),
                     reward=RewardLatency((RewardTask("math", 1.0, rng.uniform(1e-3, 0.5), 1.5, 5.0),)),
                     block_size=16, max_num_seqs=rng.randint(4, 64))


def random_workload(rng: random.Random, prompts: int, group_size: int) -> TraceWorkload:
    rows = []
    for _ in range(prompts):
        d = rng.lognormvariate(0.0, 1.0)                      # per-prompt difficulty: long tail
        rows.append((rng.randint(1, 40), tuple(max(1, min(400, int(20 * d * rng.lognormvariate(0, 0.5))))
                                              for _ in range(group_size))))
    return TraceWorkload("prop", tuple(rows))


class Recorder(Controller):
    """The real controller; `check(self)` runs after every decision, `calls` records each train call."""

    def __init__(self, *a: Any, check: Callable[["Recorder"], None] | None = None, **kw: Any):
        super().__init__(*a, **kw)
        self.check, self.calls = check, []

    def decide(self, backend) -> None:
        super().decide(backend)
        self.v.check()
        if self.check is not None:
            self.check(self)

    def train(self, backend, call, gids) -> None:
        self.calls.append((self.v.trainer.version, call, [self.v.groups[g] for g in gids]))
        super().train(backend, call, gids)


def sim_run(preset: str, seed: int, engines: int, group_size: int, prompts: int, steps: int,
            overrides: dict | None = None, counters_s: float = 0.5, check=None):
    rng = random.Random(seed)
    w = random_workload(rng, 64, group_size)
    backend = SimBackend(random_cost(rng), w, engines, 1, seed=seed, counters_every_s=counters_s)
    counter = iter(range(10**9))

    def source(n: int) -> list[PromptItem]:
        return [PromptItem(i % 64, RunList.of(1, w.prompt(i % 64).prompt_len), None)
                for i in (next(counter) for _ in range(n))]

    log = EventLog()
    ctl = Recorder(sched.load_preset(preset, overrides or {}), source, group_size=group_size,
                   prompts_per_step=prompts, total_steps=steps, log=log, check=check)
    ctl.run(backend)
    return ctl, log.events, w


def trained_trajectories(ctl: Recorder) -> dict[tuple[int, int], Any]:
    """(group, sample) -> trajectory over every train call; fails on a trajectory trained twice."""
    out = {}
    for _, _, groups in ctl.calls:
        for g in groups:
            for t in g.trajectories:
                key = (g.group_id, t.sample_index)
                assert key not in out, f"trajectory {key} trained twice"
                out[key] = t
    return out


def check_nothing_lost(ctl: Recorder, events, w: TraceWorkload) -> None:
    """Every trajectory of a trained group was trained, whole: its tokens are the concatenation of all its parts
    (as long as the workload says), with one version per token; nothing was dropped."""
    trained = trained_trajectories(ctl)
    for _, _, groups in ctl.calls:
        for g in groups:
            assert sorted(t.sample_index for t in g.trajectories) == list(range(g.size)), "group not whole"
            for t in g.trajectories:
                want = w.response_len(t.prompt_index, t.sample_index)
                assert len(t.response_ids) == len(t.logprobs) == len(t.versions) == want
    assert not any(e.kind == "trajectory_aborted" for e in events)
    assert len(trained) == sum(len(g.trajectories) for _, _, gs in ctl.calls for g in gs)

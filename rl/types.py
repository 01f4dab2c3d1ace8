"""Plain data that flows engines -> controller -> trainer. No tensors here: lists of ints and floats pickle cheaply
over torch.distributed object collectives and serialise into checkpoints as they are."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class RunLengthSequence(Sequence):
    """A read-only sequence stored as runs of equal values, `runs` = ((value, count), ...): the simulator's fake
    per-token lists (sim/tokens.py). A Trajectory reads its version bounds from the runs, not from every token."""
    runs: tuple[tuple[Any, int], ...]


@dataclass(frozen=True)
class RewardResult:
    """A reward function's verdict on one response (rl/rewards.py)."""
    reward: float
    correct: bool
    failed: bool = False  # the scorer itself broke (timeout, exception): not the response's fault
    reason: str = ""


def version_bounds(versions: Sequence[int]) -> tuple[int, int]:
    """(oldest, newest) of per-token versions; (-1, -1) for no tokens."""
    if isinstance(versions, RunLengthSequence):
        runs = versions.runs
        if len(runs) == 1:      # one version throughout (the common case)
            v = runs[0][0]
            return v, v
        vs = [v for v, _ in runs]
        return (min(vs), max(vs)) if vs else (-1, -1)
    return (min(versions), max(versions)) if versions else (-1, -1)


@dataclass
class Trajectory:
    """One sampled response to one prompt, as the engine produced it and the reward scored it.

    `logprobs[i]` is the behaviour policy's log-probability of `response_ids[i]` under the raw model (temperature
    applied, no top-p/top-k truncation), and `versions[i]` the weight version that produced that token: all equal
    unless a policy allowed the trajectory to be interrupted and resumed under newer weights.
    """
    group_id: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = "length"  # "stop" | "length" | "abort" | "error"
    reward: float | None = None
    correct: bool | None = None
    prompt_index: int = -1  # position of the prompt in the dataset (for logs and data-order checks)
    meta: dict = field(default_factory=dict)  # timings, engine id, anything a policy wants to carry
    # Multi-turn episodes (rl/env.py): 1 where response_ids[i] is the model's, 0 where it is an environment
    # observation (appended and prefilled, never trained on; its logprob 0.0). None: every response token is the
    # model's (single-turn).
    loss_mask: list[int] | None = None

    @property
    def version(self) -> int:
        """The (oldest) weight version this trajectory was generated under (-1: no tokens)."""
        return version_bounds(self.versions)[0]

    @property
    def newest_version(self) -> int:
        """The version of its newest token (-1: no tokens); a resumed trajectory never goes below it."""
        return version_bounds(self.versions)[1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class Group:
    """The G trajectories sampled for one prompt. GRPO advantages need all of them, so a group moves whole."""
    group_id: int
    prompt_index: int
    answer: str | None
    trajectories: list[Trajectory]

    @property
    def rewards(self) -> list[float]:
        return [t.reward if t.reward is not None else 0.0 for t in self.trajectories]

    @property
    def version(self) -> int:
        return min(t.version for t in self.trajectories)

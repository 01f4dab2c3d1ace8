"""Plain data that flows engines -> controller -> trainer. No tensors here: lists of ints and floats pickle cheaply
over torch.distributed object collectives and serialise into checkpoints as they are."""
from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def version(self) -> int:
        """The (oldest) weight version this trajectory was generated under."""
        runs = getattr(self.versions, "runs", None)  # run-length encoded (the simulator's sim.tokens.RunList)
        if runs is not None:
            return min((v for v, _ in runs), default=-1)
        return min(self.versions) if self.versions else -1

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

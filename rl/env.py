"""The environment interface of multi-turn, tool-using episodes.

An episode alternates model turns and environment observations:

    prompt -> model turn 1 -> observation 1 -> model turn 2 -> ... -> model turn k (no tool call: the answer)

After each model turn (generation stopped at EOS or at a stop token), the rollout rank asks the environment what the
turn does (`Environment.act`): a `ToolCall` to run, or nothing (the episode ends; the reward function scores the
transcript). A call runs off the decode loop (`Environment.run`, in a worker thread, under `timeout_s`), and its
result comes back as text that `Environment.observation` wraps in the model's format (for Qwen3: a `tool` message
of its chat template); the observation's tokens are appended to the episode and prefilled, never trained on
(`Trajectory.loss_mask`). An episode also ends at `max_turns` model turns, or when the response reaches its token cap.

Failures never crash a rank: a tool that raises, times out or is unknown gives an `Observation` with `failed=True`
whose text tells the model what went wrong (the episode goes on); an environment whose own code raises ends the
episode with finish_reason "error" (scored 0, counted).

An `Environment` is stateless across episodes and, within one, a function of the transcript so far: a resumed
episode (after an interrupt, a migration or a checkpoint) continues from its trajectory alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    """A call parsed from a model turn: the tool's name and its arguments as the model wrote them."""
    name: str
    arguments: str


@dataclass(frozen=True)
class Observation:
    """A tool's result as text the model reads next; `failed`: the tool raised, timed out or was unknown."""
    text: str
    failed: bool = False
    seconds: float = 0.0   # wall time the call took (or its timeout)


class Environment(Protocol):
    """What a rollout rank needs from an environment (rl/tools.py has the ones shipped)."""
    max_turns: int       # model turns per episode at most (the last one is not followed by a call)
    timeout_s: float     # one tool call's time limit

    def act(self, turn_text: str) -> ToolCall | None:
        """The tool call in this model turn's text, or None: the turn is the episode's answer."""

    def run(self, call: ToolCall) -> Observation:
        """Run the call (may block; the caller enforces `timeout_s`); exceptions are the caller's to catch."""

    def observation(self, obs: Observation) -> str:
        """The text appended after the model turn: the result in the model's format, ending where the model's next
        turn begins (for a chat model: the tool message and the assistant header)."""

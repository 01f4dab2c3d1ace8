"""A multi-turn episode as tokens: what a rollout rank appends after a model turn, what the environment and the
reward read, all as pure functions of the trajectory so far (so a resumed episode needs nothing else).

An episode's response is its model turns and the observations between them, in order:

    response_ids = turn_1 + obs_1 + turn_2 + obs_2 + ... + turn_k          loss_mask = 1...1 0...0 1...1 0...0 1...1

Each model turn is the tokens the engine sampled, up to and including the token it stopped at (EOS, or a stop
token of the environment's format: `stop_token_ids`, plain's "="); each
observation is `env.observation(obs)` tokenized alone, without the tokenizer's own special tokens
(`observation_ids`; for Qwen3 these are the very ids the whole conversation tokenizes to, tests/rl/test_tools.py).
An observation is never empty, so the model turns are exactly the maximal runs of 1 in the mask (`model_turns`).

Text: a turn's text is `decode(turn_ids)` with the run's response decoder (runtime/samples.py `response_decoder`:
the final EOS dropped, other special tokens kept). The environment reads the text of the latest turn (`next_call`;
the plain format reads the turn's line, which for a first turn begins in the prompt); **the reward sees the text of
the episode's last model turn** (`reward_text`), scored against the
prompt's answer as a single-turn response is. An episode ends when a turn makes no call, when it is the
`env.max_turns`-th, or when the response reaches its token cap (finish_reason "length"; the worker does not ask
`next_call` about a turn that did not stop at EOS or a stop token).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rl.env import Environment, Observation, ToolCall


def observation_ids(tokenizer: Any, env: Environment, obs: Observation) -> list[int]:
    """The token ids appended after a model turn for `obs`: `env.observation(obs)` tokenized without special
    tokens added (no BOS). Never empty (ValueError otherwise: the turns would run together)."""
    ids = list(tokenizer(env.observation(obs), add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"observation {obs!r} tokenizes to no tokens")
    return ids


def build_episode(turns: Sequence[Sequence[int]], observations: Sequence[Sequence[int]]
                  ) -> tuple[list[int], list[int]]:
    """(response_ids, loss_mask) of model turns interleaved with observation token ids: turn_1 obs_1 turn_2 ...
    `observations` has one entry per turn but the last (a finished episode) or one per turn (an episode waiting
    for its next turn, or cut at its token cap right after an observation)."""
    if len(observations) not in (len(turns) - 1, len(turns)):
        raise ValueError(f"{len(turns)} model turns need {len(turns) - 1} or {len(turns)} observations, got "
                         f"{len(observations)}")
    ids: list[int] = []
    mask: list[int] = []
    for i, turn in enumerate(turns):
        ids += turn
        mask += [1] * len(turn)
        if i < len(observations):
            if not observations[i]:
                raise ValueError(f"observation {i} is empty")
            ids += observations[i]
            mask += [0] * len(observations[i])
    return ids, mask


def model_turns(response_ids: Sequence[int], loss_mask: Sequence[int] | None) -> list[list[int]]:
    """The model turns of a response: the maximal runs of mask 1 (None: the whole response is one turn)."""
    if loss_mask is None:
        return [list(response_ids)] if response_ids else []
    check_mask(response_ids, loss_mask)
    turns: list[list[int]] = []
    prev = 0
    for tok, m in zip(response_ids, loss_mask):
        if m:
            if not prev:
                turns.append([])
            turns[-1].append(tok)
        prev = m
    return turns


def check_mask(response_ids: Sequence[int], loss_mask: Sequence[int]) -> None:
    """ValueError unless `loss_mask` has one 0/1 entry per response token."""
    if len(loss_mask) != len(response_ids):
        raise ValueError(f"loss_mask has {len(loss_mask)} entries for {len(response_ids)} response tokens")
    if any(m not in (0, 1) for m in loss_mask):
        raise ValueError("loss_mask entries must be 0 (observation) or 1 (model token)")


def reward_text(decode: Callable[[list[int]], str], response_ids: Sequence[int],
                loss_mask: Sequence[int] | None) -> str:
    """The text the reward scores: the last model turn, decoded (a single-turn response: all of it)."""
    turns = model_turns(response_ids, loss_mask)
    return decode(turns[-1]) if turns else ""


def next_call(env: Environment, decode: Callable[[list[int]], str], prompt_ids: Sequence[int],
              response_ids: Sequence[int], loss_mask: Sequence[int] | None) -> ToolCall | None:
    """After a model turn stopped (at EOS or one of `stop_token_ids`): the call it makes, or None when the episode
    is over (no call, or the turn was the `env.max_turns`-th). The environment reads the turn's decoded text, or
    what its `call_text` makes of it (the plain format: the turn's line, which for a first turn begins in the
    prompt)."""
    turns = model_turns(response_ids, loss_mask)
    if not turns or len(turns) >= env.max_turns:
        return None
    text = decode(turns[-1])
    call_text = getattr(env, "call_text", None)
    if call_text is not None:
        text = call_text(decode(list(prompt_ids)), text, len(turns) == 1)
    return env.act(text)


def stop_token_ids(env: Environment, tokenizer: Any) -> tuple[int, ...]:
    """The token ids that end a model turn besides EOS (`env.stop`, each one token; ValueError otherwise): what a
    rollout rank adds to a multi-turn request's SamplingParams.stop_token_ids."""
    out = []
    for text in getattr(env, "stop", ()):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"stop text {text!r} is {len(ids)} tokens for this tokenizer, not one")
        out.append(ids[0])
    return tuple(out)


def append_observation(response_ids: list[int], logprobs: list[float], versions: list[int], loss_mask: list[int],
                       obs_ids: Sequence[int], version: int) -> None:
    """Extend a trajectory's per-token lists in place by an observation: its ids, log-prob 0.0, the engine's
    `version` when it was appended, mask 0 (Trajectory's conventions, rl/types.py)."""
    n = len(obs_ids)
    response_ids += obs_ids
    logprobs += [0.0] * n
    versions += [version] * n
    loss_mask += [0] * n

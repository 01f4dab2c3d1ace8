"""A sample on its way through a rollout rank: its per-sample seed (the same on every engine and every resume), a
finished engine output or an interrupted request as a GRPO trajectory, and the text its reward sees."""
from __future__ import annotations

from typing import Any, Callable

from engine.sequence import RequestOutput, UnfinishedRequest
from rl.types import Trajectory


def request_seed(run_seed: int, group_id: int, sample_index: int) -> int:
    """Per-sample seed: a sample's tokens do not depend on batching, engine or timing (reproducible runs)."""
    return (run_seed * 1_000_003 + group_id * 9_973 + sample_index) % (2**63 - 1)


def trajectory_of(out: RequestOutput) -> Trajectory:
    """A finished engine output as a GRPO trajectory (engine timings in `meta`); reward not yet scored."""
    return Trajectory(
        group_id=out.group_id, sample_index=out.sample_index, prompt_ids=list(out.prompt_ids),
        response_ids=list(out.token_ids), logprobs=list(out.logprobs), versions=list(out.versions),
        finish_reason=out.finish_reason, prompt_index=out.prompt_index, loss_mask=out.mask,
        meta=dict(arrival_time=out.arrival_time, first_token_time=out.first_token_time, finish_time=out.finish_time,
                  num_preemptions=out.num_preemptions))


def partial_of(u: UnfinishedRequest, meta: dict[str, Any]) -> Trajectory:
    """An interrupted request, as the engine exported it, as a partial trajectory (its tokens so far, and a
    multi-turn one's loss mask)."""
    r = u.request
    return Trajectory(group_id=r.group_id, sample_index=r.sample_index, prompt_ids=list(r.prompt_ids),
                      response_ids=list(u.token_ids), logprobs=list(u.logprobs), versions=list(u.versions),
                      finish_reason="interrupted", prompt_index=r.prompt_index, meta=meta,
                      loss_mask=list(u.mask) if u.mask is not None else None)


def response_decoder(tok: Any, eos_ids: frozenset[int]) -> Callable[[list[int]], str]:
    """Text the reward sees: the final EOS dropped, every other special token kept, so a policy cannot earn reward
    by padding with special tokens that a skip-special-tokens decode would hide."""
    def decode(ids: list[int]) -> str:
        return tok.decode(ids[:-1] if ids and ids[-1] in eos_ids else ids, skip_special_tokens=False)
    return decode


def observation_encoder(tok: Any) -> Callable[[str], list[int]]:
    """An observation's text as the tokens appended after a model turn: tokenized alone, no special tokens added
    (rl/episode.py `observation_ids`)."""
    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])
    return encode

"""Multi-turn requests between turns: held with their KV, extended with an observation, ended.

A request submitted with `GenRequest.multi_turn` does not finish when a turn stops (EOS or a stop token): it is
held (`hold`). Its sequence leaves the running batch (its decode slot free) but keeps its KV blocks, and the step
returns its output so far with `held=True`. The caller then either extends it (`extend`: the observation's tokens
are appended with logprob 0.0, mask 0 and the engine's version, and it is queued again: only those tokens and the
last sampled one, whose K/V was never computed, are prefilled, never the history) or ends it (`end`: its episode is
over, its blocks go back). A held request's blocks count against the pool; when the pool runs dry its KV is dropped
before anything running is preempted (engine/scheduler.py), and recomputed when it is extended: correct, slower.
A turn that ends at the token cap ("length") or in an error finishes the request as usual.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sequence import RequestId, RequestOutput, Sequence, SeqStatus

if TYPE_CHECKING:
    from engine.engine import LLMEngine


def hold(engine: LLMEngine, seq: Sequence, now: float) -> RequestOutput:
    """A multi-turn request's turn stopped: hold it; its output so far (`held`)."""
    seq.finish_reason, seq.finish_time = "stop", now
    engine.scheduler.hold(seq)
    return seq.output()


def held_seq(engine: LLMEngine, request_id: RequestId) -> Sequence:
    seq = engine.seqs.get(request_id)
    if seq is None or seq.status is not SeqStatus.HELD:
        state = "not in this engine" if seq is None else seq.status.name.lower()
        raise KeyError(f"request {request_id!r} is not held between turns ({state})")
    return seq


def room(engine: LLMEngine, request_id: RequestId) -> int:
    """How many tokens a held request may be extended by and still have one to generate (within max_new_tokens
    and the model length)."""
    seq = held_seq(engine, request_id)
    return min(seq.params.max_new_tokens - seq.num_generated, engine.max_model_len - seq.num_tokens) - 1


def extend(engine: LLMEngine, request_id: RequestId, token_ids: list[int]) -> None:
    """Append `token_ids` to a held request and queue it to generate its next turn."""
    seq = held_seq(engine, request_id)
    tokens = [int(t) for t in token_ids]
    if not tokens:
        raise ValueError(f"request {request_id!r}: extended by no tokens")
    if len(tokens) > room(engine, request_id):
        raise ValueError(f"request {request_id!r}: {len(tokens)} tokens appended leave none to generate "
                         f"(room for {room(engine, request_id)})")
    seq.observe(tokens, engine.version)
    seq.finish_reason = None
    engine.scheduler.unhold(seq)


def end(engine: LLMEngine, request_id: RequestId, reason: str) -> RequestOutput:
    """Finish a held request (its episode is over): its blocks back to the pool; its final output."""
    seq = held_seq(engine, request_id)
    engine.scheduler.remove(seq)
    seq.finish_reason, seq.finish_time = reason, engine.clock()
    return engine.seqs.pop(request_id).output()

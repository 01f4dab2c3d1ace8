"""Several decode steps in one C call (cpu/engine.py `CpuEngine`, `_steps_ahead`; cpu/csrc/decode_forward.c
`decode_steps_f32`): the same tokens, logprobs, finish reasons and versions, bit for bit, as one step at a time and
as the op-by-op forward, with stop tokens mid-call, lengths that differ, block boundaries every few tokens, shared
prompts and two threads; taken only where it reproduces one step at a time; the engine's generator left as one
step at a time leaves it; bad input raises."""
from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, GenRequest, LLMEngine, SamplingParams
from cpu import forward as cpu_forward
from model.presets import preset_config
from model.transformer import Transformer

pytestmark = pytest.mark.skipif(not cpu_forward.available(), reason="no C compiler or no sgemm_ in torch's library")

V = 20


def tiny() -> Transformer:
    return Transformer(preset_config("tiny", vocab_size=V, eos_token_id=1)).init_weights(seed=0)


def engine(steps: int, **kw) -> LLMEngine:
    cfg = dict(block_size=4, num_kv_tokens=64 * 64, max_num_seqs=64, max_batch_tokens=512, seed=0,
               cpu_decode_steps=steps)
    return LLMEngine(tiny(), EngineConfig(**{**cfg, **kw}))


def requests(n: int = 48, draw: int = 0, **params) -> list[GenRequest]:
    """Groups of 4 samples of one prompt (3-20 tokens), 1-40 new tokens each, EOS a stop token (a random-init model
    samples it within ~20 tokens, so requests stop mid-call)."""
    rng = random.Random(draw)
    out = []
    for g in range(n // 4):
        prompt = [rng.randrange(2, V) for _ in range(rng.randrange(3, 20))]
        for i in range(4):
            p = dict(temperature=1.0, max_new_tokens=rng.randrange(1, 40), seed=g * 4 + i)
            out.append(GenRequest(prompt, SamplingParams(**{**p, **params}), group_id=g))
    return out


def outputs(eng: LLMEngine, reqs: list[GenRequest]) -> list[tuple]:
    return [(o.token_ids, o.logprobs, o.sampling_logprobs, o.finish_reason, o.versions) for o in eng.generate(reqs)]


class Calls:
    """Wraps the runner's `decode_steps`: the step count asked of each call, and whether requests were waiting."""

    def __init__(self, eng: LLMEngine):
        self.eng, self.inner, self.ks, self.waiting = eng, eng.runner.decode_steps, [], []
        eng.runner.decode_steps = self

    def __call__(self, seqs, k, *args):
        self.ks.append(k)
        self.waiting.append(len(self.eng.scheduler.waiting))
        return self.inner(seqs, k, *args)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_several_steps_a_call_give_the_bits_of_one_step_at_a_time_and_of_op_by_op(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one, op_by_op = engine(1), engine(1, cpu_forward=False)
        want = outputs(one, requests())
        assert outputs(op_by_op, requests()) == want
        assert any(r[3] == "stop" for r in want) and any(r[3] == "length" for r in want)   # both ways mid-call
        for steps in (3, 8):
            many = engine(steps)
            calls = Calls(many)
            assert outputs(many, requests()) == want, steps
            assert max(calls.ks) <= steps and sum(calls.ks) > 2 * len(calls.ks)   # the calls ran several steps
            assert many.num_steps == one.num_steps and many.num_tokens_decoded == one.num_tokens_decoded
            assert many.block_manager.num_free == many.block_manager.num_blocks   # every block back in the pool
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("params", [dict(seed=None), dict(top_p=0.9), dict(temperature=0.0)],
                         ids=["unseeded", "top-p", "greedy"])
@pytest.mark.slow
def test_batches_the_c_loop_would_not_reproduce_run_one_step_at_a_time(params):
    want = outputs(engine(1), requests(16, **params))
    many = engine(8)
    calls = Calls(many)
    assert outputs(many, requests(16, **params)) == want
    assert calls.ks == []


def test_no_steps_ahead_while_requests_wait_to_be_admitted_nor_past_the_free_blocks():
    want = outputs(engine(1, max_num_seqs=8), requests(32))
    many = engine(8, max_num_seqs=8)
    calls = Calls(many)
    assert outputs(many, requests(32)) == want
    assert calls.ks and not any(calls.waiting)   # the last requests, once nobody waits
    # a pool with room for a few blocks beyond what the running sequences hold: fewer steps, or one at a time
    tight_want = outputs(engine(1, num_kv_tokens=4 * 40), requests(8, max_new_tokens=30))
    tight = engine(16, num_kv_tokens=4 * 40)
    assert outputs(tight, requests(8, max_new_tokens=30)) == tight_want


def test_the_engine_generator_is_left_as_one_step_at_a_time_leaves_it():
    one, many = engine(1), engine(8)
    calls = Calls(many)
    for eng in (one, many):
        eng.generate(requests(8))
    assert calls.ks
    assert outputs(many, requests(8, draw=1, seed=None)) == outputs(one, requests(8, draw=1, seed=None))


def test_non_finite_logits_end_a_request_with_an_error_as_one_step_at_a_time_does():
    results = []
    for steps in (1, 8):
        eng = engine(steps)
        calls = Calls(eng)
        ids = [eng.add_request(r) for r in requests(8, max_new_tokens=30)]
        outs = {}
        eng.config.cpu_decode_steps = 1
        for _ in range(3):   # prefill, then decode a few tokens
            outs.update((o.request_id, o) for o in eng.step())
        with torch.no_grad():
            eng.runner.model.lm_head.weight[3].fill_(float("nan"))   # every row's logits non-finite from now on
        eng.config.cpu_decode_steps = steps
        while eng.has_unfinished():
            outs.update((o.request_id, o) for o in eng.step())
        results.append([(outs[i].token_ids, outs[i].finish_reason) for i in ids])
        assert (calls.ks != []) == (steps > 1)
    assert results[0] == results[1] and "error" in {r for _, r in results[0]}


def test_bad_input_raises():
    with pytest.raises(ValueError, match="cpu_decode_steps must be >= 1"):
        EngineConfig(cpu_decode_steps=0)
    eng = engine(8)
    fwd = eng.runner.cpu_forward
    T, k, D = 2, 3, eng.runner.model.config.head_dim
    args = dict(ids=torch.tensor([2, 3]), cos=torch.ones(k, T, D), sin=torch.zeros(k, T, D),
                slots=torch.zeros(k, T, dtype=torch.long), block_tables=torch.zeros(T, 4, dtype=torch.int32),
                row_len=torch.ones(T, dtype=torch.int32), temps=torch.ones(T), u=torch.full((k, T), 0.5),
                stops=torch.full((T, 1), -1, dtype=torch.long))
    tokens, logprobs, counts = fwd.steps(**args)
    assert counts.tolist() == [k, k] and tokens.shape == (k, T) and bool(torch.isfinite(logprobs).all())
    with pytest.raises(IndexError, match="outside the pool"):
        fwd.steps(**{**args, "block_tables": torch.full((T, 4), 10**6, dtype=torch.int32)})
    with pytest.raises(ValueError, match="u must be a contiguous CPU torch.float32 tensor of shape"):
        fwd.steps(**{**args, "u": torch.full((k + 1, T), 0.5)})

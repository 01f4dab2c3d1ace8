"""Prefix-cache entries never survive a version change: after LLMEngine.load_weights, no KV block computed under
the old weights is reused, not by the running group's siblings, nor by a new request of the same group and prompt
(group prefix sharing forks KV blocks from a leader: engine/block_manager.py)."""
import pytest
import torch

from engine import GenRequest, SamplingParams
from model import load_model
from tests.support.engine import assert_pool_whole, drain, engine, packed_logprobs, prompts, sharp_model


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    sharp_model("qwen3", a, seed=0)
    sharp_model("qwen3", b, seed=1)
    return a, b


def params(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=6, seed=500 + i, ignore_eos=True)


@pytest.mark.parametrize("max_seqs", [8, 2])  # 2: some siblings still wait to fork from the leader at the load
def test_no_block_of_the_old_version_is_reused_after_a_load(two_models, max_seqs):
    a, b = two_models
    prompt = prompts((23,), seed=3)[0]  # 5 full blocks of 4 and a partial one
    eng = engine(load_model(a), max_num_seqs=max_seqs)
    for i in range(4):
        eng.add_request(GenRequest(prompt, params(i), request_id=f"old{i}", group_id=9, sample_index=i))
    eng.step()
    eng.step()
    assert eng.block_manager.num_used > 0
    eng.load_weights(load_model(b).state_dict(), version=1)
    assert eng.block_manager.num_used == 0  # nothing computed by version 0 is held any more
    # a new request of the same group and prompt arrives while its siblings wait to be recomputed
    eng.add_request(GenRequest(prompt, params(4), request_id="new", group_id=9, sample_index=4))
    outs = {o.request_id: o for o in drain(eng)}
    assert_pool_whole(eng)
    # reference: the new request alone on a fresh engine that only ever held version 1 (same seed, same tokens)
    ref = engine(load_model(b), max_num_seqs=max_seqs)
    want = ref.generate([GenRequest(prompt, params(4), group_id=-1)])[0]
    got = outs["new"]
    assert got.versions == [1] * 6 and got.token_ids == want.token_ids
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
    # the siblings' version-1 tokens read only version-1 KV: their logprobs are version 1's training forward over
    # the prompt and every token so far (a stale prompt block would shift them)
    old = [outs[f"old{i}"] for i in range(4)]
    exact = packed_logprobs(load_model(b).eval(), old)
    stale = packed_logprobs(load_model(a).eval(), old)
    for o, lp, lp_a in zip(old, exact, stale):
        k = o.versions.count(0)
        assert o.versions == [0] * k + [1] * (6 - k) and k < 6
        assert torch.allclose(torch.tensor(o.logprobs[k:]), lp[k:], atol=1e-4)
        assert torch.allclose(torch.tensor(o.logprobs[:k]), lp_a[:k], atol=1e-4)

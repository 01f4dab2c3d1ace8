"""What a weight load does to the running sequences' KV: by default (AReaL's interrupt, the `areal` weight sync) they
are preempted and recomputed under the new weights, so no KV of the old weights is read again; with `keep_kv`
(PipelineRL's in-flight weight update, the `in_flight` weight sync) they keep it and go on decoding, with no
prefill, their next tokens tagged with the new version."""
import pytest
import torch

from engine import GenRequest, SamplingParams
from model import load_model
from tests.support.engine import assert_pool_whole, drain, engine, packed_logprobs, prompts, sharp_model

NEW = 8


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    sharp_model("qwen3", a, seed=0)
    sharp_model("qwen3", b, seed=1)
    return a, b


@pytest.mark.parametrize("keep_kv", [False, True])
def test_a_load_recomputes_the_running_kv_unless_told_to_keep_it(two_models, keep_kv):
    a, b = two_models
    eng = engine(load_model(a))
    for i, p in enumerate(prompts((9, 14, 6), seed=5)):
        eng.add_request(GenRequest(p, SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=70 + i,
                                                     ignore_eos=True), request_id=f"r{i}", group_id=i))
    while min(eng.seqs[f"r{i}"].num_generated for i in range(3)) < 2:
        eng.step()
    at_load = {rid: (s.num_tokens, s.num_generated) for rid, s in eng.seqs.items()}
    assert all(0 < k < NEW for _, k in at_load.values())
    prefilled, preempted = eng.num_prefill_tokens, eng.stats().num_preemptions
    assert eng.running_with_kv() == 3
    eng.load_weights(load_model(b).state_dict(), version=1, keep_kv=keep_kv)
    assert eng.version == 1
    assert eng.running_with_kv() == (3 if keep_kv else 0)   # what the runtime's weights_loaded reports as kept_kv
    outs = {o.request_id: o for o in drain(eng)}
    assert_pool_whole(eng)
    for rid, (_, k) in at_load.items():                    # tokens before the load: version 0; after: version 1
        assert outs[rid].versions == [0] * k + [1] * (NEW - k)
    old = [outs[rid] for rid in sorted(at_load)]
    exact = packed_logprobs(load_model(b).eval(), old)       # version 1 reading only version-1 KV
    close = [torch.allclose(torch.tensor(o.logprobs[k:]), lp[k:], atol=1e-4)
             for o, lp, (_, k) in zip(old, exact, (at_load[rid] for rid in sorted(at_load)))]
    if keep_kv:
        assert eng.num_prefill_tokens == prefilled          # no re-prefill: each sequence went on decoding
        assert eng.stats().num_preemptions == preempted
        assert not all(close)                               # their new tokens attended to version-0 KV
    else:
        # each running sequence recomputed prompt + tokens so far under the new weights (AReaL's interrupt)
        assert eng.num_prefill_tokens == prefilled + sum(n for n, _ in at_load.values())
        assert eng.stats().num_preemptions == preempted + len(at_load)
        assert all(close)

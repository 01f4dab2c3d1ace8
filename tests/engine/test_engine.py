"""The engine end to end on tiny random models of the three families: greedy parity with transformers' generate,
logprobs against the training forward, prefix sharing, preemption, abort, export/import, weight loading, stats.
Every scenario ends by checking that the KV pool is whole again."""
import pytest
import torch

from engine import EngineConfig, GenRequest, LLMEngine, SamplingParams
from model import load_model
from tests.support.helpers import FAMILIES
from tests.support.engine import assert_pool_whole, drain, engine, packed_logprobs, prompts, sharp_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


@pytest.fixture(scope="module", params=FAMILIES)
def models(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = sharp_model(request.param, path)
    return hf, load_model(path).eval()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("q3")
    hf = sharp_model("qwen3", path)
    return hf, load_model(path).eval(), path


def hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])  # an explicit mask, or generate() masks out any token equal to pad_token_id
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=2,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


# ---- parity ----------------------------------------------------------------------------------------------------
LENGTHS = (1, 5, 16, 17, 40, 9)


# the CPU paths: C paged attention + oneDNN packed Linear layers (every one: these models' are all small),
# plain PyTorch (batched SDPA, F.linear)
CPU_PATHS = {"native": dict(cpu_packed_min_weight=0), "torch": dict(attention="batched", cpu_packed_linear=False)}


@pytest.fixture(scope="module")
def hf_greedy_parity(models):
    """transformers' greedy outputs on the parity prompts, computed once per family: both CPU paths compare with
    them (a fixed model, greedy: the same every time)."""
    hf, _ = models
    return [hf_greedy(hf, p, GREEDY.max_new_tokens) for p in prompts(LENGTHS)]


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(CPU_PATHS))
def test_greedy_matches_transformers_generate(models, hf_greedy_parity, path):
    _, ours = models
    ps = prompts(LENGTHS)
    want = hf_greedy_parity
    eng = engine(ours, **CPU_PATHS[path])
    outs = eng.generate([GenRequest(p, GREEDY) for p in ps])
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == ("stop" if o.token_ids[-1] == 2 else "length") for o in outs)
    assert_pool_whole(eng)
    # scarce blocks: 12 blocks of 4 tokens for six sequences of up to 64 tokens -> preemption by recompute
    eng = engine(ours, num_kv_tokens=64, max_batch_tokens=16, **CPU_PATHS[path])
    outs = eng.generate([GenRequest(p, GREEDY) for p in ps])
    assert [o.token_ids for o in outs] == want
    assert eng.scheduler.num_preemptions > 0 and sum(o.num_preemptions for o in outs) > 0
    assert_pool_whole(eng)


def test_kernels_reference_attention_gives_the_same_tokens(qwen3):
    hf, ours, _ = qwen3
    ps = prompts((3, 11, 6))
    a = engine(ours, attention="kernels", max_batch_tokens=8).generate([GenRequest(p, GREEDY) for p in ps])
    b = engine(ours, attention="batched").generate([GenRequest(p, GREEDY) for p in ps])
    c = engine(ours, attention="native", max_batch_tokens=8).generate([GenRequest(p, GREEDY) for p in ps])
    assert ([o.token_ids for o in a] == [o.token_ids for o in b] == [o.token_ids for o in c]
            == [hf_greedy(hf, p, 24) for p in ps])


# ---- logprobs --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
@pytest.mark.parametrize("path", sorted(CPU_PATHS))
def test_logprobs_match_training_forward(models, temperature, top_k, path):
    _, ours = models
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=20, seed=i) for i in range(6)]
    # chunked prefill and preemption included: the KV the logprobs come from must be right whichever way it was built
    eng = engine(ours, num_kv_tokens=96, max_batch_tokens=12, **CPU_PATHS[path])
    outs = eng.generate([GenRequest(p, sp) for p, sp in zip(prompts(LENGTHS, seed=1), params)])
    assert eng.scheduler.num_preemptions > 0
    for o, ref in zip(outs, packed_logprobs(ours, outs, temperature)):
        assert (torch.tensor(o.logprobs) - ref).abs().max() < 1e-4
        if top_k:  # the sampling distribution is the renormalised top-k: its logprob is at least the raw one
            assert all(s >= r - 1e-5 for s, r in zip(o.sampling_logprobs, o.logprobs))
    assert_pool_whole(eng)


# ---- prefix sharing --------------------------------------------------------------------------------------------
def test_group_shares_prompt_blocks_and_matches_independent_requests(qwen3):
    _, ours, _ = qwen3
    prompt = prompts((37,))[0]  # 9 full blocks of 4 and a partial one
    G = 4
    params = [SamplingParams(temperature=1.0, max_new_tokens=12, seed=100 + i, ignore_eos=True) for i in range(G)]
    eng = engine(ours)
    for i, sp in enumerate(params):
        eng.add_request(GenRequest(prompt, sp, group_id=7, sample_index=i))
    eng.step()
    assert eng.block_manager.num_used == 10  # the prompt's blocks, allocated once for the whole group
    assert eng.stats().num_prefill_tokens == 37
    eng.step()
    assert eng.block_manager.num_used == 10 + G - 1  # copy-on-write of the partial block for all but the last
    grouped = {}
    while eng.has_unfinished():
        grouped.update((o.sample_index, o) for o in eng.step())
    assert_pool_whole(eng)
    solo = engine(ours)
    outs = [solo.generate([GenRequest(prompt, sp, group_id=-1)])[0] for sp in params]
    assert solo.stats().num_prefill_tokens == G * 37
    for i, o in enumerate(outs):
        assert grouped[i].token_ids == o.token_ids
        assert torch.allclose(torch.tensor(grouped[i].logprobs), torch.tensor(o.logprobs), atol=1e-5)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # different seeds, different samples


# ---- abort, export / import --------------------------------------------------------------------------------------
def test_abort_running_waiting_leader_and_fork(qwen3):
    _, ours, _ = qwen3
    ps = prompts((20, 6, 8))
    sp = [SamplingParams(temperature=1.0, max_new_tokens=10, seed=i) for i in range(6)]
    reqs = [GenRequest(ps[0], sp[0], request_id="solo"),
            *[GenRequest(ps[1], sp[i], group_id=3, sample_index=i, request_id=f"g{i}") for i in (1, 2, 3)],
            GenRequest(ps[2], sp[4], request_id="late")]
    eng = engine(ours, max_num_seqs=4, max_batch_tokens=8)  # 8 tokens/step: the prompts are chunked
    for r in reqs:
        eng.add_request(r)
    eng.step()  # "solo" took the whole budget; the group waits, "late" waits
    assert eng.abort("late").finish_reason == "abort" and eng.abort("late") is None
    eng.step()
    eng.step()  # "solo" decodes, the group's leader g1 is mid-prefill with forks g2, g3
    assert [f.request_id for f in eng.seqs["g1"].forks] == ["g2", "g3"]
    out = eng.abort("g1")
    assert out.token_ids == [] and out.finish_reason == "abort"
    assert eng.abort("g3") is not None  # a fork still waiting for its (new) leader
    eng.step()
    mid = eng.abort("solo")
    assert 0 < len(mid.token_ids) < 10 and len(mid.logprobs) == len(mid.token_ids)
    rest = drain(eng)
    assert [o.request_id for o in rest] == ["g2"]
    assert_pool_whole(eng)
    # g2 is what it would have been alone
    alone = engine(ours).generate([GenRequest(ps[1], sp[2])])[0]
    assert rest[0].token_ids == alone.token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_export_import_continues_identically(qwen3, temperature):
    _, ours, _ = qwen3
    ps = prompts((7, 13))
    sp = SamplingParams(temperature=temperature, max_new_tokens=16, seed=5)
    want = engine(ours).generate([GenRequest(p, sp) for p in ps])
    a, b = engine(ours), engine(ours, block_size=8)
    ids = [a.add_request(GenRequest(p, sp)) for p in ps]
    for _ in range(6):
        a.step()
    moved = a.export(ids[1])
    assert 0 < len(moved.token_ids) < 16 and len(moved.versions) == len(moved.token_ids)
    rest = drain(a)
    b.import_request(moved)
    got = drain(b)
    assert rest[0].token_ids == want[0].token_ids
    assert got[0].token_ids == want[1].token_ids and got[0].request_id == ids[1]
    assert torch.allclose(torch.tensor(got[0].logprobs), torch.tensor(want[1].logprobs), atol=1e-5)
    assert_pool_whole(a)
    assert_pool_whole(b)
    with pytest.raises(KeyError):
        a.export("nope")


# ---- weights ---------------------------------------------------------------------------------------------------
def test_load_weights_switches_model_and_version(qwen3, tmp_path):
    hf_a, ours, path = qwen3
    hf_b = sharp_model("qwen3", tmp_path / "b", seed=1)
    model = load_model(path)
    eng = engine(model, num_kv_tokens=256)
    ps = prompts((9, 4, 21))
    before = eng.generate([GenRequest(p, GREEDY) for p in ps])
    assert [o.token_ids for o in before] == [hf_greedy(hf_a, p, 24) for p in ps]
    assert all(o.versions == [0] * len(o.token_ids) for o in before)
    new = load_model(tmp_path / "b").state_dict()
    assert eng.load_weights(iter(new.items()), version=1) == len(new)
    after = eng.generate([GenRequest(p, GREEDY) for p in ps])
    assert [o.token_ids for o in after] == [hf_greedy(hf_b, p, 24) for p in ps]
    assert all(set(o.versions) == {1} for o in after) and eng.stats().version == 1
    assert_pool_whole(eng)
    # mid-generation: tokens so far keep version 1, the rest are generated by model A recomputing the whole context
    ids = [eng.add_request(GenRequest(p, GREEDY)) for p in ps]
    for _ in range(5):
        eng.step()
    eng.load_weights(load_model(path).state_dict(), version=2)
    assert eng.block_manager.num_used == 0  # nothing computed by the old weights survives
    outs = {o.request_id: o for o in drain(eng)}
    for rid, p in zip(ids, ps):
        o = outs[rid]
        k = o.versions.count(1)
        assert 0 < k < len(o.versions) and o.versions == [1] * k + [2] * (len(o.versions) - k)
        assert o.token_ids[k:] == hf_greedy(hf_a, p + o.token_ids[:k], 24 - k)
    assert_pool_whole(eng)
    with pytest.raises(KeyError):
        eng.load_weights({"nope": torch.zeros(1)}, version=3)


# ---- stats, validation -------------------------------------------------------------------------------------------
def test_stats_report_queue_kv_and_counters(qwen3):
    _, ours, _ = qwen3
    eng = engine(ours, max_num_seqs=2)
    ids = [eng.add_request(GenRequest(p, SamplingParams(temperature=0, max_new_tokens=5))) for p in prompts((6, 3, 4))]
    s = eng.stats()
    assert s.waiting == ids and s.running == [] and s.kv_blocks_used == 0 and s.version == 0
    assert s.kv_blocks_total == 256 and s.block_size == 4
    eng.step()
    s = eng.stats()
    assert s.running == ids[:2] and s.waiting == ids[2:] and s.kv_blocks_used == 3
    assert s.num_steps == 1 and s.num_tokens_decoded == 2 and s.num_prefill_tokens == 9
    assert s.kv_blocks_used + s.kv_blocks_free == s.kv_blocks_total
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().num_tokens_decoded == 15
    assert_pool_whole(eng)


def test_rejects_requests_that_cannot_fit(qwen3):
    _, ours, _ = qwen3
    eng = engine(ours, num_kv_tokens=32)
    with pytest.raises(ValueError):
        eng.add_request(GenRequest(list(range(3, 40)), GREEDY))
    out = eng.generate([GenRequest(list(range(3, 20)), SamplingParams(temperature=0, max_new_tokens=100))])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 32 - 17  # capped by the pool
    assert_pool_whole(eng)


# ---- GPU -------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_with_graphs(qwen3):
    """Triton kernels through the dispatchers and decode CUDA graphs: logprobs match the training forward (on CPU),
    greedy tokens match the CPU engine (allowing one sequence to differ: TF32 in a kernel may flip a near-tie)."""
    _, ours, path = qwen3
    ps = prompts((3, 17, 30, 9, 1, 12, 25, 40, 2))
    eng = LLMEngine(load_model(path, device="cuda"), EngineConfig(block_size=16, num_kv_tokens=4096, max_num_seqs=8))
    assert eng.runner.graphs is not None
    outs = eng.generate([GenRequest(p, SamplingParams(max_new_tokens=24, seed=i)) for i, p in enumerate(ps)])
    assert eng.runner.graphs.num_replays > 0
    for o, ref in zip(outs, packed_logprobs(ours, outs)):
        assert (torch.tensor(o.logprobs) - ref).abs().max() < 2e-3
    greedy = eng.generate([GenRequest(p, GREEDY) for p in ps])
    cpu = engine(ours).generate([GenRequest(p, GREEDY) for p in ps])
    assert sum(a.token_ids != b.token_ids for a, b in zip(greedy, cpu)) <= 1
    assert_pool_whole(eng)


# ---- everything at once ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_tokens,max_seqs,max_tokens", [(80, 6, 10), (60, 8, 12), (40, 4, 5)])
def test_scheduling_does_not_change_seeded_outputs(qwen3, kv_tokens, max_seqs, max_tokens):
    """Seeded requests are independent of what else runs: a roomy engine and a cramped one (chunked prefill,
    preemption of groups mid-prefill and of forks sharing blocks, aborts) must produce the same tokens."""
    _, ours, _ = qwen3
    rng = torch.Generator().manual_seed(7)
    reqs = []
    for g in range(8):
        prompt = torch.randint(3, 128, (int(torch.randint(1, 30, (1,), generator=rng)),), generator=rng).tolist()
        for i in range(int(torch.randint(1, 5, (1,), generator=rng))):
            sp = SamplingParams(temperature=[0.0, 1.0, 0.8][(g + i) % 3], top_k=[0, 0, 10][i % 3], seed=g * 10 + i,
                                max_new_tokens=int(torch.randint(1, 16, (1,), generator=rng)))
            reqs.append(GenRequest(prompt, sp, group_id=g, sample_index=i, request_id=f"{g}.{i}"))
    roomy = {o.request_id: o for o in engine(ours, max_num_seqs=64).generate(reqs)}
    cramped = engine(ours, num_kv_tokens=kv_tokens, max_num_seqs=max_seqs, max_batch_tokens=max_tokens)
    for r in reqs:
        cramped.add_request(r)
    outs, step = {}, 0
    while cramped.has_unfinished():
        outs.update((o.request_id, o) for o in cramped.step())
        step += 1
        if step % 7 == 0 and cramped.seqs:  # abort someone now and then, wherever it is
            victim = sorted(cramped.seqs)[step % len(cramped.seqs)]
            outs[victim] = cramped.abort(victim)
    assert cramped.scheduler.num_preemptions > 0
    aborted = [k for k, o in outs.items() if o.finish_reason == "abort"]
    assert 0 < len(aborted) < len(reqs) // 2
    for k, o in outs.items():
        if o.finish_reason != "abort":
            assert o.token_ids == roomy[k].token_ids, k
            assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(roomy[k].logprobs), atol=1e-4)
        else:
            assert o.token_ids == roomy[k].token_ids[:len(o.token_ids)], k
    assert_pool_whole(cramped)

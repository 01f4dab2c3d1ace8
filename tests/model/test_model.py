"""Our decoder against transformers' AutoModelForCausalLM on the same random weights, and HF-layout save/load."""
import json

import pytest
import torch

from model import CheckpointError, ModelConfig, ModelConfigError, cu_seqlens_from_lengths, load_model, save_model
from model.transformer import Transformer
from tests.support.helpers import FAMILIES, make_hf_model


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, path)
    return hf, load_model(path).eval(), path


def test_single_sequence_logits_match_transformers(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, 128, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got = ours.forward_packed(ids, cu_seqlens_from_lengths([37]))
    assert (got - ref).abs().max().item() < 1e-4


def test_packed_sequences_match_separate_transformers_calls(pair):
    hf, ours, _ = pair
    lens = [5, 1, 23, 200]  # 200 > the llama config's original context, so rope scaling matters
    ids = torch.randint(0, 128, (sum(lens),), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = torch.cat([hf(x[None]).logits[0] for x in ids.split(lens)])
        got = ours.forward_packed(ids, cu_seqlens_from_lengths(lens))
    assert (got - ref).abs().max().item() < 1e-4


def reference_flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """model.attention.flash_varlen's contract, sequence by sequence through SDPA with the bottom-right causal mask
    (the CPU has no flash kernel); checks the metadata a flash kernel relies on."""
    from model.attention import _sdpa
    assert cu_q.dtype == cu_k.dtype == torch.int32 and len(cu_q) == len(cu_k) and int(cu_q[-1]) == q.shape[0]
    assert int(cu_k[-1]) == k.shape[0] == v.shape[0]
    nq, nk = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
    assert max_q == max(nq, default=0) and max_k == max(nk, default=0) and all(m >= n for n, m in zip(nq, nk))
    outs = []
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        mask = torch.ones(b - a, d - c, dtype=torch.bool).tril((d - c) - (b - a))
        outs.append(_sdpa(q[a:b], k[c:d], v[c:d], scale, mask=mask))
    return torch.cat(outs)


def test_packed_attention_equals_a_block_causal_mask(monkeypatch):
    import model.attention as attention
    from model.attention import PackedCausal, _sdpa
    g = torch.Generator().manual_seed(5)
    lens = [3, 9, 1, 6]
    q, k, v = (torch.randn(sum(lens), h, 8, generator=g) for h in (4, 2, 2))
    seq = torch.repeat_interleave(torch.arange(4), torch.tensor(lens))
    pos = torch.arange(sum(lens))
    mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    ref = _sdpa(q, k, v, 8 ** -0.5, mask=mask)
    assert torch.allclose(PackedCausal.from_lengths(lens)(0, q, k, v), ref, atol=1e-6)
    # the flash varlen path (CUDA's) with the reference kernel in its place: the same
    monkeypatch.setattr(attention, "uses_flash_varlen", lambda q: True)
    monkeypatch.setattr(attention, "flash_varlen", reference_flash_varlen)
    assert torch.allclose(PackedCausal.from_lengths(lens)(0, q, k, v), ref, atol=1e-6)


def test_shared_prefix_attention_equals_each_prompt_plus_child_packed_alone_outputs_and_gradients(monkeypatch):
    """Families with prompts of different lengths, an empty child and a family whose only child is empty: the
    outputs and the gradients of q, k, v (the prompt's summed over its children) equal packing every prompt + child
    as its own sequence, with each prompt's own outputs taken from its first sample."""
    import model.attention as attention
    from model.attention import PackedCausal, SharedPrefixCausal
    monkeypatch.setattr(attention, "flash_varlen", reference_flash_varlen)   # the CPU has no flash kernel
    g = torch.Generator().manual_seed(6)
    plens, clens, fam = [3, 5, 1], [4, 0, 2, 6, 0], [0, 0, 1, 1, 2]
    T = sum(plens) + sum(clens)
    q0, k0, v0 = (torch.randn(T, h, 8, generator=g) for h in (4, 2, 2))
    dout = torch.randn(T, 4, 8, generator=g)
    attn = SharedPrefixCausal(plens, clens, fam)
    assert not attn.use_rows(torch.device("cpu"))   # 13 prompt tokens copied for 12 children's: the masked way
    q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
    out = attn.padded(0, q, k, v)
    (out * dout).sum().backward()
    # the other two ways agree: the masked call, and the varlen calls (CUDA's way; here the reference kernel)
    for way in (attn, attn.varlen):
        q3, k3, v3 = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out3 = way(0, q3, k3, v3)
        (out3 * dout).sum().backward()
        assert torch.allclose(out3, out, atol=1e-5)
        for a, b in ((q, q3), (k, k3), (v, v3)):
            assert torch.allclose(a.grad, b.grad, atol=1e-5)
    # the reference: each child's prompt copied in front of it; a prompt's outputs come from its family's first row
    pstart = [0, 3, 8]
    cstart = [sum(plens) + sum(clens[:c]) for c in range(len(clens))]
    rows, first = [], {}
    for c, f in enumerate(fam):
        rows.append(list(range(pstart[f], pstart[f] + plens[f])) + list(range(cstart[c], cstart[c] + clens[c])))
        first.setdefault(f, c)
    src = torch.tensor([i for r in rows for i in r])
    q2, k2, v2 = (x.clone().requires_grad_() for x in (q0, k0, v0))
    ref_rows = PackedCausal.from_lengths([len(r) for r in rows])(0, q2[src], k2[src], v2[src])
    at = {}
    offset = 0
    for c, r in enumerate(rows):
        for j, i in enumerate(r):
            if i >= sum(plens) or first[fam[c]] == c:   # a child's token, or its prompt's in the family's first row
                at[i] = offset + j
        offset += len(r)
    ref = ref_rows[torch.tensor([at[i] for i in range(T)])]
    assert torch.allclose(out, ref, atol=1e-5)
    (ref * dout).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_flash_varlen_ways_match_sdpa_on_cuda(dtype):
    """On CUDA in half precision both backends take `flash_varlen` (flash-attn's or PyTorch's own kernel,
    bottom-right causal): outputs and gradients against SDPA (the shared prompts' padded rows; a block-causal mask
    for plain packing), with GQA, an empty child and a family whose only child is empty."""
    from model.attention import PackedCausal, SharedPrefixCausal, _sdpa, uses_flash_varlen
    g = torch.Generator().manual_seed(7)
    plens, clens, fam = [37, 5, 64], [100, 0, 3, 250, 17, 0], [0, 0, 1, 1, 0, 2]
    T = sum(plens) + sum(clens)
    q0, k0, v0 = (torch.randn(T, h, 128, generator=g).to(dtype).cuda() for h in (16, 8, 8))
    dout = torch.randn(T, 16, 128, generator=g).to(dtype).cuda()
    assert uses_flash_varlen(q0)

    def run(way, n):
        q, k, v = (x[:n].clone().requires_grad_() for x in (q0, k0, v0))
        out = way(0, q, k, v)
        (out.float() * dout[:n].float()).sum().backward()
        return out, q.grad, k.grad, v.grad

    shared = SharedPrefixCausal(plens, clens, fam)
    for a, b in zip(run(shared, T), run(shared.padded, T)):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    lens = [37, 100, 5, 3, 250]
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).cuda()
    pos = torch.arange(sum(lens)).cuda()
    mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    ref = lambda layer, q, k, v: _sdpa(q, k, v, 128 ** -0.5, mask=mask)   # noqa: E731
    for a, b in zip(run(PackedCausal.from_lengths(lens, "cuda"), sum(lens)), run(ref, sum(lens))):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_shared_prefix_attention_takes_rows_for_short_prompts_and_the_mask_for_long_ones_on_cpu_only():
    from model.attention import SharedPrefixCausal
    cpu, cuda = torch.device("cpu"), torch.device("cuda")   # a device's type is all the choice reads
    grpo = SharedPrefixCausal([12, 20], [255] * 8 + [200] * 8, [0] * 8 + [1] * 8)    # prompts 6% of the rows
    assert grpo.use_rows(cpu) and grpo.use_rows(cuda)
    unshared = SharedPrefixCausal([512], [1535], [0])   # bench/train.py's GPU shape: one sample per prompt
    assert not unshared.use_rows(cpu) and unshared.use_rows(cuda)
    long_context = SharedPrefixCausal([2048], [256] * 8, [0] * 8)                    # 8 x 2048 copied for 8 x 256
    assert not long_context.use_rows(cpu) and long_context.use_rows(cuda)   # CUDA: the rows' flash kernel, planned


def test_gradients_match_transformers(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(4))
    hf.zero_grad(); ours.zero_grad()
    hf(ids[None]).logits[0].logsumexp(-1).sum().backward()
    ours.forward_packed(ids, cu_seqlens_from_lengths([16])).logsumexp(-1).sum().backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.allclose(p.grad, theirs[name].grad, atol=1e-4, rtol=1e-3), name


def test_save_load_round_trip_is_bit_identical(pair, tmp_path):
    _, ours, src = pair
    save_model(ours, ours.config, tmp_path / "out")
    again = load_model(tmp_path / "out")
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert again.config.tie_word_embeddings == ours.config.tie_word_embeddings
    if ours.config.tie_word_embeddings:
        assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()
    # and what we wrote loads in transformers with the same logits
    from transformers import AutoModelForCausalLM
    hf2 = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (11,))
    with torch.no_grad():
        assert (hf2(ids[None]).logits[0] - ours.forward_packed(ids, cu_seqlens_from_lengths([11]))).abs().max() < 1e-4


def test_sharded_save_writes_index_and_loads(pair, tmp_path):
    _, ours, _ = pair
    save_model(ours, ours.config, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = load_model(tmp_path / "sharded")
    for k, v in ours.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_bf16_load_and_save_keep_dtype(pair, tmp_path):
    _, ours, src = pair
    m = load_model(src, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    save_model(m, m.config, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    again = load_model(tmp_path / "bf16")
    assert torch.equal(again.model.embed_tokens.weight, m.model.embed_tokens.weight)


def test_old_style_config_keys_are_understood():
    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                                   num_hidden_layers=1, num_attention_heads=2, rope_theta=1234.0,
                                   rope_scaling={"type": "linear", "factor": 2.0}))
    assert cfg.rope_theta == 1234.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4


@pytest.mark.parametrize("bad, needle", [
    (dict(model_type="gpt2"), "model_type 'gpt2'"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope type 'yarn'"),
    (dict(hidden_size=0), "hidden_size must be a positive integer"),
    (dict(use_sliding_window=True), "use_sliding_window"),
])
def test_unsupported_configs_are_rejected_by_name(bad, needle):
    d = dict(model_type="qwen3", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=2, head_dim=4)
    d.update(bad)
    with pytest.raises(ModelConfigError, match=needle):
        ModelConfig.from_hf(d)


def test_bad_model_directories_fail_clearly(pair, tmp_path):
    _, ours, src = pair
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path / "empty")
    # weights of the wrong shape for the config
    bad = tmp_path / "bad"
    save_model(ours, ours.config, bad)
    d = json.loads((bad / "config.json").read_text())
    d["intermediate_size"] = 100
    (bad / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="mlp"):
        load_model(bad)
    # a tensor missing
    from safetensors.torch import load_file, save_file
    save_model(ours, ours.config, bad)
    sd = load_file(str(bad / "model.safetensors"))
    sd.pop("model.norm.weight")
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_model(bad)


def test_random_init_builds_from_config_alone():
    cfg = ModelConfig(family="qwen3", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=8, qk_norm=True, tie_word_embeddings=True)
    a = Transformer(cfg).init_weights(seed=0)
    b = Transformer(cfg).init_weights(seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("family,qk_norm,bias,tied", [("qwen3", True, False, True), ("qwen2", False, True, False),
                                                     ("llama", False, False, False)])
def test_num_params_counts_what_the_module_holds(family, qk_norm, bias, tied):
    """ModelConfig.num_params (train.py --check's memory plan) against the parameters the module really has."""
    cfg = ModelConfig(family, vocab_size=97, hidden_size=32, intermediate_size=80, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, qk_norm=qk_norm, attention_bias=bias, tie_word_embeddings=tied)
    model = Transformer(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())

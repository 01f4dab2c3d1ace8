"""The engine's fused ops (engine/fused.py, kernels/swiglu.py, rmsnorm.py, rope.py): the kernels against their
references, the fused model against the eager one (same parameters, every family), eager whenever a gradient is
recorded, and an engine with the fused ops generating what the engine without them generates. Through Triton's
interpreter on CPU (TIDAL_KERNELS=triton), through the C kernels of cpu/ops.py for fp32 on the CPU (the
default there), and the Triton checks on CUDA when there is one."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine import EngineConfig, GenRequest, LLMEngine, SamplingParams
from engine.fused import FusedAttention, FusedMLP, FusedTransformer, use_fused_ops
from cpu import ops as cpu_train
from kernels.dispatch import interpreting
from kernels.rmsnorm import rms_norm, rms_norm_ref
from kernels.rope import rope, rope_ref
from kernels.swiglu import silu_mul, silu_mul_ref
from model import PackedCausal, load_model
from tests.support.helpers import FAMILIES, make_hf_model

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_c = pytest.mark.skipif(not cpu_train.available(), reason=f"no C kernels: {cpu_train.unavailable_reason()}")
# the interpreter rounds bf16 toward zero, the kernels round to nearest on a GPU: a couple of bf16 ulps either way
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"fused-{request.param}")
    hf = make_hf_model(request.param, seed=3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))  # norm weights off one, so a missing weight would show
    hf.save_pretrained(str(path))
    return request.param, path


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 48), (3, 1031), (0, 16)])
def test_silu_mul_kernel_matches_reference(dtype, shape):
    g, u = (torch.randn(*shape) * 4).to(dtype), torch.randn(*shape).to(dtype)
    if shape[0]:
        g[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    got = silu_mul(g, u, impl="triton")
    assert got.dtype == dtype and got.shape == g.shape
    torch.testing.assert_close(got.float(), silu_mul_ref(g, u).float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_interpreter
def test_silu_mul_takes_strided_views_and_rejects_mismatches():
    gu = torch.randn(6, 2 * 40)
    g, u = gu[:, :40], gu[:, 40:]  # the halves of a merged gate/up projection: not contiguous
    torch.testing.assert_close(silu_mul(g, u, impl="triton"), silu_mul_ref(g, u), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="must match"):
        silu_mul(g, u[:, :39])
    with pytest.raises(ValueError, match="must match"):
        silu_mul(g, u.double())


@needs_c
def test_c_kernels_match_their_references(monkeypatch):
    monkeypatch.delenv("TIDAL_KERNELS", raising=False)
    calls = []
    for name in ("rms_norm_infer", "rotary_inplace", "silu_mul_infer"):
        real = getattr(cpu_train, name)
        monkeypatch.setattr(cpu_train, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    g = torch.Generator().manual_seed(0)
    x, res, w = torch.randn(37, 64, generator=g), torch.randn(37, 64, generator=g), torch.rand(64, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=1e-6, rtol=1e-5)
        y, s = rms_norm(x, w, 1e-6, res)
        y_ref, s_ref = rms_norm_ref(x, w, 1e-6, res)
        assert torch.equal(s, s_ref)   # the residual stream: the same single rounding as torch's add
        torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
        q, k = torch.randn(37, 4, 16, generator=g), torch.randn(37, 2, 16, generator=g)
        cos, sin = torch.randn(37, 16, generator=g), torch.randn(37, 16, generator=g)
        want = rope_ref(q, k, cos, sin)
        got = rope(q, k, cos, sin)
        assert got[0].data_ptr() != q.data_ptr()   # not in place unless asked
        qi, ki = q.clone(), k.clone()
        got_inplace = rope(qi, ki, cos, sin, inplace=True)
        assert got_inplace[0].data_ptr() == qi.data_ptr() and got_inplace[1].data_ptr() == ki.data_ptr()
        for a, b in zip([*got, *got_inplace], [*want, *want]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        up = torch.randn(37, 96, generator=g)
        torch.testing.assert_close(silu_mul(up, up * 2), silu_mul_ref(up, up * 2), atol=1e-6, rtol=1e-5)
    assert calls == ["rms_norm_infer", "rms_norm_infer", "rotary_inplace", "rotary_inplace", "rotary_inplace",
                     "rotary_inplace", "silu_mul_infer"]
    with torch.no_grad():   # bf16 and strided in-place rotations stay on the reference
        rope(q.bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16())
        rope(q.transpose(0, 1).contiguous().transpose(0, 1), k, cos, sin, inplace=True)
    xg = x.clone().requires_grad_()
    assert rms_norm(xg, w, 1e-6).grad_fn is not None   # a recorded gradient keeps the reference (autograd)
    assert len(calls) == 7


def _forward(model, ids, lengths):
    pos = torch.cat([torch.arange(n) for n in lengths]).to(ids.device)
    return model(ids, pos, PackedCausal.from_lengths(lengths, ids.device))


def _check_family(path, dtype, device):
    eager = load_model(path, device=device).to(dtype).eval()
    fused = copy.deepcopy(eager)
    swapped = use_fused_ops(fused)
    cfg = eager.config
    assert swapped == 1 + 2 * cfg.num_layers
    assert type(fused) is FusedTransformer and type(fused.model.layers[0].self_attn) is FusedAttention
    assert type(fused.model.layers[-1].mlp) is FusedMLP
    assert use_fused_ops(fused) == 0  # already swapped
    assert fused.state_dict().keys() == eager.state_dict().keys()
    lengths = [7, 1, 12]
    ids = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        want, got = _forward(eager, ids, lengths), _forward(fused, ids, lengths)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype] * max(1.0, scale), rtol=TOL[dtype])
    # with a gradient recorded the forward is the eager one, exactly, and it back-propagates
    got = _forward(fused, ids, lengths)
    want = _forward(eager, ids, lengths)
    assert torch.equal(got, want)
    got.float().square().mean().backward()
    assert fused.model.layers[0].mlp.gate_proj.weight.grad is not None


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_model_matches_eager(family_model, dtype, monkeypatch):
    monkeypatch.setenv("TIDAL_KERNELS", "triton")
    _check_family(family_model[1], dtype, "cpu")


@needs_c
def test_fused_model_matches_eager_through_the_c_kernels(family_model, monkeypatch):
    monkeypatch.delenv("TIDAL_KERNELS", raising=False)
    import cpu.engine as ef
    calls = []
    real = ef.C.rms_norm
    def counted(x, w, eps, residual=None):
        calls.append(residual is not None)
        return real(x, w, eps, residual)
    monkeypatch.setattr(ef, "C", dataclasses.replace(ef.C, rms_norm=counted))
    _check_family(family_model[1], torch.float32, "cpu")
    layers = load_model(family_model[1]).config.num_layers
    assert calls.count(True) == 2 * layers   # every block norm but the first, and the final one, add the residual


def test_fused_model_is_eager_where_no_kernel_is_chosen(family_model, monkeypatch):
    """TIDAL_KERNELS=ref (and, by default, a CPU tensor that is not fp32): the swapped model runs exactly the eager
    ops."""
    monkeypatch.setenv("TIDAL_KERNELS", "ref")
    eager = load_model(family_model[1]).eval()
    fused = copy.deepcopy(eager)
    use_fused_ops(fused)
    ids = torch.randint(0, eager.config.vocab_size, (9,))
    with torch.no_grad():
        assert torch.equal(_forward(fused, ids, [4, 5]), _forward(eager, ids, [4, 5]))


@pytest.mark.parametrize("kernels", [pytest.param("triton", marks=needs_interpreter), pytest.param("c", marks=needs_c)])
def test_engine_with_fused_ops_generates_as_without(family_model, monkeypatch, kernels):
    """The engine swaps the ops in where a kernel runs (TIDAL_KERNELS=triton on CPU; by default the C kernels for
    fp32 on the CPU), and its greedy tokens and their logprobs are those of an engine with `fused_ops=False` (the
    same kernels otherwise)."""
    if kernels == "triton":
        monkeypatch.setenv("TIDAL_KERNELS", "triton")
    else:
        monkeypatch.delenv("TIDAL_KERNELS", raising=False)
    path = family_model[1]
    ps = [[5, 9, 2, 7, 30, 11], [3], [8, 8, 8, 1, 2]]
    outs = {}
    for fused in (True, False):
        eng = LLMEngine(load_model(path), EngineConfig(block_size=4, num_kv_tokens=128, max_num_seqs=4,
                                                       fused_ops=fused))
        assert (type(eng.runner.model) is FusedTransformer) == fused
        outs[fused] = eng.generate([GenRequest(p, SamplingParams(temperature=0, max_new_tokens=6)) for p in ps])
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)


def test_fused_ops_off_gives_the_eager_model_back(family_model, monkeypatch):
    """`fused_ops=False` is authoritative: a model an earlier engine swapped runs eager again (the bench's
    unfused baseline reuses one model), and `fused_sampling=False` keeps the sampler off its kernel."""
    monkeypatch.setenv("TIDAL_KERNELS", "triton")
    model = load_model(family_model[1])
    LLMEngine(model, EngineConfig(block_size=4, num_kv_tokens=64, max_num_seqs=2, cuda_graphs=False))
    assert type(model) is FusedTransformer
    eng = LLMEngine(model, EngineConfig(block_size=4, num_kv_tokens=64, max_num_seqs=2, fused_ops=False,
                                        fused_sampling=False))
    assert type(model).__name__ == "Transformer" and type(model.model.layers[0].mlp).__name__ == "MLP"
    assert not eng.sampler.fused


def test_engine_on_cpu_keeps_the_eager_model_where_no_kernel_runs(family_model, monkeypatch):
    monkeypatch.delenv("TIDAL_KERNELS", raising=False)
    eng = LLMEngine(load_model(family_model[1]).bfloat16(), EngineConfig(block_size=4, num_kv_tokens=64,
                                                                        max_num_seqs=2))
    assert type(eng.runner.model).__name__ == "Transformer"   # bf16 on the CPU: no C kernel
    monkeypatch.setenv("TIDAL_KERNELS", "ref")
    eng = LLMEngine(load_model(family_model[1]), EngineConfig(block_size=4, num_kv_tokens=64, max_num_seqs=2))
    assert type(eng.runner.model).__name__ == "Transformer"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_model_matches_eager_on_cuda(family_model, dtype):
    _check_family(family_model[1], dtype, "cuda")

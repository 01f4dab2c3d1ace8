"""The engine's fused GPU ops (engine/gpu_fused.py, kernels/swiglu.py): the SwiGLU kernel against its reference,
the fused model against the eager one (same parameters, every family), eager whenever a gradient is recorded, and
an engine with the fused ops generating what the engine without them generates. On CPU through Triton's
interpreter (TIDAL_KERNELS=triton); the same checks on CUDA when there is one."""
from __future__ import annotations

import copy

import pytest
import torch

from engine import EngineConfig, GenRequest, LLMEngine, SamplingParams
from engine.gpu_fused import FusedAttention, FusedMLP, FusedTransformer, use_fused_gpu_ops
from kernels.dispatch import interpreting
from kernels.swiglu import silu_mul, silu_mul_ref
from model import PackedCausal, load_model
from tests.helpers import FAMILIES, make_hf_model

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
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


def _forward(model, ids, lengths):
    pos = torch.cat([torch.arange(n) for n in lengths]).to(ids.device)
    return model(ids, pos, PackedCausal.from_lengths(lengths, ids.device))


def _check_family(path, dtype, device):
    eager = load_model(path, device=device).to(dtype).eval()
    fused = copy.deepcopy(eager)
    swapped = use_fused_gpu_ops(fused)
    cfg = eager.config
    assert swapped == 1 + 2 * cfg.num_layers
    assert type(fused) is FusedTransformer and type(fused.model.layers[0].self_attn) is FusedAttention
    assert type(fused.model.layers[-1].mlp) is FusedMLP
    assert use_fused_gpu_ops(fused) == 0  # already swapped
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


def test_fused_model_is_eager_where_triton_is_not_chosen(family_model, monkeypatch):
    """TIDAL_KERNELS=ref (and, by default, any CPU tensor): the swapped model runs exactly the eager ops."""
    monkeypatch.setenv("TIDAL_KERNELS", "ref")
    eager = load_model(family_model[1]).eval()
    fused = copy.deepcopy(eager)
    use_fused_gpu_ops(fused)
    ids = torch.randint(0, eager.config.vocab_size, (9,))
    with torch.no_grad():
        assert torch.equal(_forward(fused, ids, [4, 5]), _forward(eager, ids, [4, 5]))


@needs_interpreter
def test_engine_with_fused_ops_generates_as_without(family_model, monkeypatch):
    """The engine swaps the ops in where Triton runs (here: TIDAL_KERNELS=triton on CPU), and its greedy tokens
    and their logprobs are those of an engine with `fused_ops=False` (the same kernels otherwise)."""
    monkeypatch.setenv("TIDAL_KERNELS", "triton")
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


def test_engine_on_cpu_keeps_the_eager_model(family_model, monkeypatch):
    monkeypatch.delenv("TIDAL_KERNELS", raising=False)
    eng = LLMEngine(load_model(family_model[1]), EngineConfig(block_size=4, num_kv_tokens=64, max_num_seqs=2))
    assert type(eng.runner.model).__name__ == "Transformer"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_model_matches_eager_on_cuda(family_model, dtype):
    _check_family(family_model[1], dtype, "cuda")

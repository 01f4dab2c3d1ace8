"""The trainer's Triton ops with autograd (kernels/triton_ops/train.py) and the swapped model that calls them
(trainer/fused.py): values and gradients against the eager modules, under TRITON_INTERPRET=1 on CPU tensors and on
CUDA; the dispatch per call; `perf.fused_kernels`; the memory plan of what the fused model keeps for backward."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from cpu import ops as cpu_train
from kernels.dispatch import HAS_TRITON, interpreting
from model.config import ModelConfig
from model.presets import preset_config
from model.rope import apply_rotary
from model.transformer import Transformer

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and interpreting()),
                                       reason="Triton on CPU tensors needs triton and TRITON_INTERPRET=1")
requires_cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")


def grads(f, *xs, seed: int = 9):
    """f(*xs) and the gradients of <f(*xs), a fixed random tensor> with respect to each x (x's dtype and device)."""
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = f(*xs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype).to(out.device)
    (out * w).sum().backward()
    return out.detach(), [x.grad for x in xs]


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Equal shapes and dtypes, and |a - b| <= tol x the largest |b| (at least 1) everywhere."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.float(), b.float()
    return a.numel() == 0 or (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


# fp32: the same formulas up to the order of fp32 sums; bf16: the eager ops round every intermediate (and the
# interpreter rounds bf16 toward zero), the kernels once: a couple of ulps of the largest value
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def rms_norm_eager(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """model.transformer.RMSNorm's eager formula (its fp32 path, F.rms_norm, is the same math)."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def check_rms_norm(shape, dtype, wdtype, device="cpu"):
    from kernels.triton_ops import train
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)
    w = (torch.randn(shape[-1], generator=gen) * 0.5 + 1).to(wdtype).to(device)
    y, (dx, dw) = grads(lambda a, b: train.rms_norm(a, b, 1e-6), x, w)
    y_ref, (dx_ref, dw_ref) = grads(rms_norm_eager, x, w)
    assert train.rms_norm(x, w, 1e-6)._base is None    # no view: FSDP2 warns of a module output that is one
    tol = TOL[dtype]
    assert close(y, y_ref, tol) and close(dx, dx_ref, tol), (shape, dtype)
    # dw sums over every row: the eager bf16 backward rounds its products before the sum, the kernel does not
    assert close(dw, dw_ref, tol if dtype == torch.float32 else 5e-2), (shape, dtype, (dw - dw_ref).abs().max())


@needs_interpreter
@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("shape", [(5, 3, 48), (37, 16), (1, 8)])
def test_rms_norm_values_and_gradients_match_the_model_interpreter(shape, dtype, wdtype):
    check_rms_norm(shape, dtype, wdtype)


@needs_interpreter
def test_rms_norm_weight_gradient_sums_over_programs_and_tiles_interpreter(monkeypatch):
    """Rows of 512: 8 a tile; with one 'SM' the backward runs 4 programs of several tiles each, the last one short."""
    from kernels.triton_ops import train
    monkeypatch.setattr(train, "device_sms", lambda t: 1)
    check_rms_norm((197, 512), torch.float32, torch.float32)
    monkeypatch.setattr(train, "device_sms", lambda t: 64)     # one tile a program
    check_rms_norm((197, 512), torch.float32, torch.float32)


@needs_interpreter
def test_rms_norm_of_no_rows_and_bad_weight_interpreter():
    from kernels.triton_ops import train
    y, (dx, dw) = grads(lambda a, b: train.rms_norm(a, b, 1e-6), torch.zeros(0, 16), torch.ones(16))
    assert y.shape == (0, 16) and dx.shape == (0, 16) and torch.equal(dw, torch.zeros(16))
    with pytest.raises(ValueError, match="weight"):
        train.rms_norm(torch.zeros(3, 16), torch.ones(8), 1e-6)


def check_swiglu(dtype, device="cpu"):
    from kernels.triton_ops import train
    gen = torch.Generator().manual_seed(2)
    g = (torch.randn(9, 70, generator=gen) * 4)
    g[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])    # exp(-|g|) underflows; the gate at zero
    g, u = g.to(dtype).to(device), torch.randn(9, 70, generator=gen).to(dtype).to(device)
    y, (dg, du) = grads(train.swiglu, g, u)
    y_ref, (dg_ref, du_ref) = grads(lambda a, b: F.silu(a) * b, g, u)
    tol = TOL[dtype]
    assert close(y, y_ref, tol) and close(dg, dg_ref, tol) and close(du, du_ref, tol), dtype
    assert torch.isfinite(dg).all()


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_values_and_gradients_match_eager_interpreter(dtype):
    check_swiglu(dtype)
    from kernels.triton_ops import train
    with pytest.raises(ValueError, match="must match"):
        train.swiglu(torch.zeros(3, 4), torch.zeros(3, 5))


def check_rotary(dtype, device="cpu"):
    from kernels.triton_ops import train
    gen = torch.Generator().manual_seed(3)
    ang = torch.randn(6, 16, generator=gen) * 3
    emb = torch.cat((ang, ang), -1)
    cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
    for heads in (1, 3):
        x = torch.randn(6, heads, 32, generator=gen).to(dtype).to(device)
        y, (dx,) = grads(lambda a: train.rotary(a, cos, sin), x)
        y_ref, (dx_ref,) = grads(lambda a: apply_rotary(a, cos, sin), x)
        assert close(y, y_ref, TOL[dtype]) and close(dx, dx_ref, TOL[dtype]), (dtype, heads)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_values_and_gradients_match_eager_interpreter(dtype):
    check_rotary(dtype)
    from kernels.triton_ops import train
    with pytest.raises(ValueError, match="rotary"):
        train.rotary(torch.zeros(6, 2, 32), torch.zeros(6, 16), torch.zeros(6, 16))


def check_swapped_model(dtype, device, tol):
    """A swapped copy of a Qwen3-shaped model against the plain one: logits and every parameter's gradient."""
    from trainer.fused import TrainAttention, TrainMLP, TrainRMSNorm, use_fused_train_ops
    cfg = preset_config("tiny", vocab_size=40, eos_token_id=1)
    plain = Transformer(cfg).init_weights(seed=3).to(dtype).to(device)
    fused = copy.deepcopy(plain)
    assert use_fused_train_ops(fused, device) == cfg.num_layers * 6 + 1
    assert {type(m) for m in fused.modules()} >= {TrainRMSNorm, TrainMLP, TrainAttention}
    assert list(fused.state_dict()) == list(plain.state_dict())
    ids = torch.randint(0, 40, (50,), generator=torch.Generator().manual_seed(1)).to(device)
    cu = torch.tensor([0, 20, 50], dtype=torch.int32, device=device)
    outs = []
    for m in (plain, fused):
        logits = m.forward_packed(ids, cu)
        logits.float().logsumexp(-1).sum().backward()
        outs.append((logits.detach(), {k: p.grad for k, p in m.named_parameters()}))
    (a, ga), (b, gb) = outs
    assert close(b, a, tol)
    for k in ga:
        assert close(gb[k], ga[k], 10 * tol), (k, (gb[k].float() - ga[k].float()).abs().max())
    assert gb["model.layers.0.self_attn.q_norm.weight"].abs().sum() > 0


@needs_interpreter
def test_a_swapped_model_runs_the_triton_ops_and_matches_the_plain_one_interpreter(monkeypatch):
    """TIDAL_KERNELS=triton sends the CPU tensors to the Triton ops (the path CUDA tensors take by default)."""
    from kernels.triton_ops import train
    monkeypatch.setenv("TIDAL_KERNELS", "triton")
    calls: list[str] = []
    for name in ("rms_norm", "swiglu", "rotary"):
        op = getattr(train, name)
        monkeypatch.setattr(train, name, lambda *a, _op=op, _n=name: calls.append(_n) or _op(*a))
    check_swapped_model(torch.float32, "cpu", 1e-5)
    layers = preset_config("tiny", vocab_size=40, eos_token_id=1).num_layers
    assert calls.count("rms_norm") == 4 * layers + 1 and calls.count("swiglu") == layers
    assert calls.count("rotary") == 2 * layers


def test_the_swapped_modules_take_the_eager_ops_where_no_kernel_runs(monkeypatch):
    """bf16 on the CPU without forcing Triton: neither family applies, the eager forward runs (same bits)."""
    from trainer.fused import ops_for, use_fused_train_ops
    monkeypatch.delenv("TIDAL_KERNELS", raising=False)
    assert ops_for(torch.zeros(2, dtype=torch.bfloat16)) is None
    assert ops_for(torch.zeros(2)) is (cpu_train if cpu_train.available() else None)
    cfg = preset_config("tiny", vocab_size=40, eos_token_id=1)
    plain = Transformer(cfg).init_weights(seed=3).bfloat16()
    fused = copy.deepcopy(plain)
    use_fused_train_ops(fused, "cuda")   # swapped as for a GPU, run on the CPU
    ids, cu = torch.arange(12) % 40, torch.tensor([0, 5, 12], dtype=torch.int32)
    with torch.no_grad():
        assert torch.equal(fused.forward_packed(ids, cu), plain.forward_packed(ids, cu))


def test_fused_kernels_off_keeps_the_eager_modules():
    from config import load_config
    from trainer.trainer import Trainer
    cfg = preset_config("tiny", vocab_size=40, eos_token_id=1)

    def swapped(*overrides: str) -> int:
        run = load_config(None, list(overrides))
        trainer = Trainer(Transformer(cfg).init_weights(seed=0), run.train, fused_kernels=run.perf.fused_kernels)
        return sum(type(m).__module__ == "trainer.fused" for m in trainer.model.modules())
    assert swapped("--perf.fused_kernels=false") == 0
    assert swapped() == (cfg.num_layers * 6 + 1 if cpu_train.available() else 0)


@needs_interpreter
@pytest.mark.parametrize("qk_norm", [True, False])
def test_the_memory_plan_counts_what_the_fused_model_keeps_interpreter(monkeypatch, qk_norm):
    """runtime/memory_plan.py's bytes per token for the fused model (Triton, bf16: what a GPU trains with) against the
    tensors autograd keeps (tests/runtime/test_preflight.py's counter)."""
    from runtime.memory_plan import outside_blocks_bytes_per_token, saved_bytes_per_token
    from tests.runtime.test_preflight import saved_by_autograd
    monkeypatch.setenv("TIDAL_KERNELS", "triton")
    shape = dict(hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=qk_norm)
    cfg = ModelConfig(family="qwen3" if qk_norm else "llama", vocab_size=256, num_layers=2, **shape)
    T, b = 128, 2
    want = cfg.num_layers * T * saved_bytes_per_token(cfg, b, fused=True) \
        + T * outside_blocks_bytes_per_token(cfg, b, fused=True)
    got = saved_by_autograd(cfg, T, torch.bfloat16, fused=True)
    assert abs(got - want) / got < 0.02, (got, want)
    eager = cfg.num_layers * T * saved_bytes_per_token(cfg, b) + T * outside_blocks_bytes_per_token(cfg, b)
    assert got < 0.8 * eager    # the fused ops keep their inputs only: less than the eager ops


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_train_ops_match_eager_on_cuda(dtype):
    for shape in [(5, 3, 48), (37, 16), (4099, 2048), (3000, 16, 128)]:
        check_rms_norm(shape, dtype, dtype, "cuda")
    check_swiglu(dtype, "cuda")
    check_rotary(dtype, "cuda")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_swapped_model_matches_the_plain_one_on_cuda(dtype):
    check_swapped_model(dtype, "cuda", TOL[dtype] if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.slow
@needs_interpreter
def test_a_train_step_through_the_triton_ops_matches_the_eager_modules_interpreter(monkeypatch):
    """The Trainer's whole step (micro-batches, prompts shared, PPO epochs, activation checkpointing recomputing
    the Triton forward in backward) with the Triton ops gives the eager modules' update and metrics."""
    from config import TrainConfig
    from tests.support.trainer import SMOOTH_ADAM, make_groups, tiny_model, weights
    from trainer.trainer import Trainer
    out = []
    for fused in (False, True):
        if fused:
            monkeypatch.setenv("TIDAL_KERNELS", "triton")
        cfg = TrainConfig(lr=1e-2, activation_checkpointing=True, micro_batch_tokens=30, ppo_epochs=2, **SMOOTH_ADAM)
        tr = Trainer(tiny_model(), cfg, fused_kernels=fused)
        assert any(type(m).__module__ == "trainer.fused" for m in tr.model.modules()) == fused
        ms = [tr.train_step(make_groups(1))]   # two PPO epochs: the second runs on updated weights
        out.append((weights(tr.model), ms))
    (w_eager, m_eager), (w_fused, m_fused) = out
    for name in w_eager:
        assert torch.allclose(w_fused[name], w_eager[name], atol=1e-5, rtol=0), name
    assert m_fused[-1]["loss"] == pytest.approx(m_eager[-1]["loss"], rel=1e-5)
    assert m_fused[-1]["grad_norm"] == pytest.approx(m_eager[-1]["grad_norm"], rel=1e-4)

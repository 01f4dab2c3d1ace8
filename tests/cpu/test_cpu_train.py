"""The trainer's fused CPU ops (cpu/ops.py, trainer/fused.py) against the eager formulas: values and
gradients of each op (non-contiguous inputs, rows past a weight-gradient chunk, extreme and non-finite values),
independence from the thread count, and a whole model whose modules were swapped matching an unswapped copy."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from cpu import ops as cpu_train
from model.rope import apply_rotary

pytestmark = pytest.mark.skipif(not cpu_train.available(), reason=f"no C compiler: {cpu_train.unavailable_reason()}")


def grads(f, *xs):
    """f(*xs) and the gradients of <f(*xs), a fixed random tensor> with respect to each x."""
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = f(*xs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * w).sum().backward()
    return out.detach(), [x.grad for x in xs]


def close(a, b, tol=2e-6):
    if a.shape != b.shape:
        return False
    return a.numel() == 0 or (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def test_swiglu_values_and_gradients_match_eager_including_large_gates():
    g = torch.randn(700, 96) * 4
    g[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])   # exp(-|g|) underflows; the gate at zero
    u = torch.randn(700, 96)
    y, (dg, du) = grads(cpu_train.swiglu, g, u)
    y_ref, (dg_ref, du_ref) = grads(lambda a, b: F.silu(a) * b, g, u)
    assert close(y, y_ref) and close(dg, dg_ref) and close(du, du_ref)
    assert torch.isfinite(dg).all()
    # non-contiguous halves of one projection, as a fused gate_up would give
    gu = torch.randn(50, 2, 64)
    y, _ = grads(lambda a: cpu_train.swiglu(a[:, 0], a[:, 1]), gu)
    assert close(y, F.silu(gu[:, 0]) * gu[:, 1])


def test_swiglu_propagates_nan():
    g = torch.randn(4, 8)
    g[1, 3] = float("nan")
    y = cpu_train.swiglu(g, torch.ones(4, 8))
    assert torch.isnan(y[1, 3]) and torch.isfinite(y[0]).all()


def eager_mlp(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


# 700 rows: two whole blocks of MLP_ROWS and a partial one; a 3-D input; no rows at all
@pytest.mark.parametrize("shape", [(700, 48), (3, 5, 48), (0, 48)])
def test_mlp_values_and_gradients_match_eager(shape):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=gen)
    wg, wu = torch.randn(96, 48, generator=gen) * 0.3, torch.randn(96, 48, generator=gen) * 0.3
    wd = torch.randn(40, 96, generator=gen) * 0.2
    x[..., :1] *= 40                                          # gates far into both tails of the sigmoid
    y, g = grads(cpu_train.mlp, x, wg, wu, wd)
    y_ref, g_ref = grads(eager_mlp, x, wg, wu, wd)
    assert y.shape == (*shape[:-1], 40) and close(y, y_ref, 1e-5)
    for a, b in zip(g, g_ref):
        assert close(a, b, 1e-5)
    assert torch.isfinite(g[0]).all()


def test_mlp_refuses_weights_of_the_wrong_shapes_and_propagates_nan():
    x, w = torch.randn(5, 8), torch.randn(16, 8)
    with pytest.raises(ValueError, match="mlp: input rows of 8 with gate"):
        cpu_train.mlp(x, w, w, torch.randn(8, 12))
    with pytest.raises(ValueError, match="mlp"):
        cpu_train.mlp(x, w, torch.randn(16, 9), torch.randn(8, 16))
    x[2, 0] = float("nan")
    y = cpu_train.mlp(x, w, w, torch.randn(8, 16))
    assert torch.isnan(y[2]).all() and torch.isfinite(y[[0, 1, 3, 4]]).all()


@pytest.mark.parametrize("shape", [(1300, 64), (7, 3, 16), (0, 8)])   # 1300 rows: three weight-gradient chunks
def test_rms_norm_values_and_gradients_match_eager(shape):
    x = torch.randn(shape) * 3
    w = torch.rand(shape[-1]) + 0.5
    eps = 1e-6
    y, (dx, dw) = grads(lambda a, b: cpu_train.rms_norm(a, b, eps), x, w)
    y_ref, (dx_ref, dw_ref) = grads(lambda a, b: F.rms_norm(a, (a.shape[-1],), b, eps), x, w)
    assert y.shape == x.shape and close(y, y_ref) and close(dx, dx_ref) and close(dw, dw_ref, 1e-5)


def test_rotary_values_and_gradients_match_eager_on_a_strided_view():
    T, D = 33, 16
    pos = torch.arange(T).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))[None]
    emb = torch.cat([pos, pos], -1)
    cos, sin = emb.cos(), emb.sin()
    qkv = torch.randn(T, 6, D)
    x = qkv[:, 2:6]                           # a view, as q.view(T, H, D) of a wider projection would be
    y, (dx,) = grads(lambda a: cpu_train.rotary(a, cos, sin), x)
    y_ref, (dx_ref,) = grads(lambda a: apply_rotary(a, cos, sin), x)
    assert close(y, y_ref) and close(dx, dx_ref)
    with pytest.raises(ValueError, match="rotary"):
        cpu_train.rotary(x, cos[:-1], sin)


def test_results_do_not_depend_on_the_thread_count():
    x, w = torch.randn(1100, 64), torch.rand(64)
    g, u = torch.randn(1100, 128), torch.randn(1100, 128)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append([*grads(lambda a, b: cpu_train.rms_norm(a, b, 1e-6), x, w)[1],
                         *grads(cpu_train.swiglu, g, u)[1],
                         *grads(cpu_train.mlp, x, g[:64].T * 0.1, u[:64].T * 0.1, u[64:128] * 0.1)[1]])
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_a_swapped_model_matches_an_unswapped_copy_and_keeps_its_state_dict():
    from model.presets import preset_config
    from model.transformer import MLP, Attention, RMSNorm, Transformer
    from trainer.fused import TrainAttention, TrainMLP, TrainRMSNorm, use_fused_train_ops
    cfg = preset_config("tiny", vocab_size=40, eos_token_id=1)
    plain = Transformer(cfg).init_weights(seed=3)
    fused = copy.deepcopy(plain)
    n = use_fused_train_ops(fused, "cpu")
    assert n == cfg.num_layers * 6 + 1   # per block 2 norms, q/k norms, the MLP, the attention; the final norm
    assert {type(m) for m in fused.modules()} >= {TrainRMSNorm, TrainMLP, TrainAttention}
    assert not {type(m) for m in fused.modules()} & {RMSNorm, MLP, Attention}
    assert list(fused.state_dict()) == list(plain.state_dict())
    ids = torch.randint(0, 40, (50,), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    outs = []
    for m in (plain, fused):
        logits = m.forward_packed(ids, cu)
        logits.logsumexp(-1).sum().backward()
        outs.append((logits.detach(), {k: p.grad for k, p in m.named_parameters()}))
    (a, ga), (b, gb) = outs
    assert close(b, a, 1e-5)
    for k in ga:
        assert close(gb[k], ga[k], 1e-4), k
    assert gb["model.layers.0.self_attn.q_norm.weight"].abs().sum() > 0   # gradients reach the fused norms' weights


def test_without_the_kernels_nothing_is_swapped(monkeypatch):
    from model.presets import preset_config
    from model.transformer import Transformer
    from trainer.fused import use_fused_train_ops
    monkeypatch.setattr(cpu_train.TRAIN_OPS, "lib", None)
    monkeypatch.setattr(cpu_train.TRAIN_OPS, "error", "no C compiler")
    model = Transformer(preset_config("tiny", vocab_size=40, eos_token_id=1))
    assert use_fused_train_ops(model, "cpu") == 0
    assert not [m for m in model.modules() if type(m).__module__ == "trainer.fused"]


def test_the_ops_load_the_kernels_on_first_use_and_name_why_they_cannot(monkeypatch):
    monkeypatch.setattr(cpu_train.TRAIN_OPS, "lib", None)
    monkeypatch.setattr(cpu_train.TRAIN_OPS, "error", None)
    g = torch.randn(3, 8)
    assert close(cpu_train.swiglu(g, g), F.silu(g) * g)   # no available() call first
    monkeypatch.setattr(cpu_train.TRAIN_OPS, "lib", None)
    monkeypatch.setattr(cpu_train.TRAIN_OPS, "error", "no C compiler found")
    with pytest.raises(RuntimeError, match="no C compiler found"):
        cpu_train.rms_norm(g, torch.ones(8), 1e-6)

"""Chunked logprob + entropy: values and gradients against full log_softmax, memory bounded by the chunk size,
Triton row kernels against the PyTorch reference."""
from __future__ import annotations

import pytest
import torch

from kernels.dispatch import interpreting
from kernels.logprobs import default_chunk_size, token_logprobs, token_logprobs_naive
from kernels.memtrack import LiveBytes

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _inputs(T, H, V, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype).to(device).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype).to(device).requires_grad_()
    t = torch.randint(0, V, (T,), generator=g).to(device)
    return h, w, t


def _values_and_grads(fn, h, w, t, temperature, with_entropy, g_lp, g_ent):
    lp, ent = fn(h, w, t, temperature, with_entropy)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0)
    gh, gw = torch.autograd.grad(loss, (h, w))
    return lp, ent, gh, gw


def _compare(impl, dtype, T, H, V, chunk, temperature, with_entropy, tol, device="cpu"):
    h, w, t = _inputs(T, H, V, dtype, device)
    g_lp, g_ent = torch.randn(T, device=device), torch.randn(T, device=device)
    got = _values_and_grads(lambda *a: token_logprobs(*a[:4], chunk_size=chunk, with_entropy=a[4], impl=impl),
                            h, w, t, temperature, with_entropy, g_lp, g_ent)
    want = _values_and_grads(token_logprobs_naive, h, w, t, temperature, with_entropy, g_lp, g_ent)
    for name, a, b in zip(("logprob", "entropy", "grad_hidden", "grad_weight"), got, want):
        if a is None:
            assert b is None and not with_entropy
            continue
        torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 7, 64])  # one token per chunk, ragged last chunk, everything in one chunk
def test_reference_matches_log_softmax_fp64(chunk, temperature, with_entropy):
    _compare("ref", torch.float64, 19, 16, 100, chunk, temperature, with_entropy, 1e-10)


def test_naive_matches_textbook():
    h, w, t = _inputs(5, 8, 11)
    lp, ent = token_logprobs_naive(h, w, t, 0.5)
    p = torch.softmax(h @ w.T / 0.5, -1)
    torch.testing.assert_close(lp, p[torch.arange(5), t].log())
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1))


def test_shapes_tied_weight_and_frozen_head():
    emb = torch.nn.Embedding(50, 8)  # tied: the same parameter embeds inputs and scores outputs
    ids = torch.randint(0, 50, (2, 6))
    h = torch.tanh(emb(ids))
    lp, ent = token_logprobs(h, emb.weight, ids.roll(-1, 1), chunk_size=4, impl="ref")
    assert lp.shape == ent.shape == (2, 6)
    (lp.sum() + ent.sum()).backward()
    ref = torch.nn.Embedding(50, 8)
    ref.load_state_dict(emb.state_dict())
    h2 = torch.tanh(ref(ids))
    lp2, ent2 = token_logprobs_naive(h2.view(12, 8), ref.weight, ids.roll(-1, 1).reshape(12))
    (lp2.sum() + ent2.sum()).backward()
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad, atol=1e-5, rtol=1e-5)
    frozen = torch.randn(50, 8)  # no grad for the head: only hidden gets one
    x = torch.randn(6, 8, requires_grad=True)
    token_logprobs(x, frozen, ids[0], impl="ref")[0].sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=needs_interpreter)])
def test_entropy_computed_but_not_in_the_loss(impl):
    """Only the logprob feeds the loss (entropy logged): the entropy gradient terms are skipped, grads still exact."""
    h, w, t = _inputs(9, 16, 40, torch.float32)
    lp, ent = token_logprobs(h, w, t, 0.9, chunk_size=4, impl=impl)
    gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    lp2, _ = token_logprobs_naive(h, w, t, 0.9)
    gh2, gw2 = torch.autograd.grad(lp2.sum(), (h, w))
    torch.testing.assert_close(gh, gh2, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gw, gw2, atol=1e-5, rtol=1e-4)


def _peak_bytes(fn) -> int:
    with LiveBytes() as meter:
        lp, ent = fn()
        (lp.sum() + ent.sum()).backward()
        del lp, ent
    return meter.peak


def test_peak_memory_bounded_by_chunk():
    T, H, V, C = 512, 16, 1024, 16
    h, w, t = _inputs(T, H, V, torch.float32)
    chunked = _peak_bytes(lambda: token_logprobs(h, w, t, chunk_size=C, impl="ref"))
    naive = _peak_bytes(lambda: token_logprobs_naive(h, w, t))

    def chunks_under_autograd():  # chunked forward, but autograd keeps every chunk's logits for backward
        parts = [token_logprobs_naive(h[i:i + C], w, t[i:i + C]) for i in range(0, T, C)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    stored = _peak_bytes(chunks_under_autograd)
    # a few [C, V] fp32 transients, plus the gradients themselves (grad_weight, fp32 grad_hidden) and [T] stats
    bound = 6 * C * V * 4 + 2 * V * H * 4 + 3 * T * H * 4 + 16 * T * 4
    assert chunked <= bound, (chunked, bound)
    assert naive > 2 * bound and stored > 2 * bound, (naive, stored, bound)  # the meter does see [T, V] logits


def test_default_chunk_size():
    assert default_chunk_size(151_936) == 128 and default_chunk_size(100) >= 1 << 18
    assert default_chunk_size(151_936, "cuda") == 512 and default_chunk_size(151_936, "cpu") == 128


def test_the_memory_plan_counts_the_devices_own_logprob_chunk():
    """A GPU run's chunks are 4x a CPU run's at Qwen3's vocabulary: the plan's logprob item follows the device."""
    from model.config import ModelConfig
    from runtime.memory_plan import activation_items
    m = ModelConfig(family="qwen3", vocab_size=151_936, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16)
    item = {gpu: next(i for i in activation_items(m, 16_384, 2, True, gpu=gpu)
                      if i.name.startswith("logprob chunk")) for gpu in (True, False)}
    rest = 16_384 * (2 * 64 + 16)
    assert item[True].nbytes - rest == 3 * 4 * 512 * 151_936 and item[False].nbytes - rest == 3 * 4 * 128 * 151_936


@needs_interpreter
@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 1.0)])
def test_triton_interpreter(dtype, temperature, with_entropy):
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    _compare("triton", dtype, 19, 16, 70, 8, temperature, with_entropy, tol)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_gpu(dtype):
    tol = 2e-3 if dtype == torch.float32 else 5e-2
    _compare("triton", dtype, 1024, 1024, 32_000, 128, 0.8, True, tol, device="cuda")
    _compare("ref", dtype, 1024, 1024, 32_000, 128, 0.8, True, tol, device="cuda")

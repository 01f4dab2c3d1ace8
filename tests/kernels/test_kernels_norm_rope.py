"""Fused RMSNorm (+ residual) and rotary embedding: references against the model's own modules, Triton kernels
against the references."""
from __future__ import annotations

import pytest
import torch

from kernels.dispatch import interpreting
from kernels.rmsnorm import rms_norm, rms_norm_ref
from kernels.rope import rope, rope_ref
from model.rope import apply_rotary
from model.transformer import RMSNorm

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# bf16/fp16: the kernel rounds once (and the interpreter rounds bf16 toward zero): allow a couple of ulps
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _cos_sin(T: int, d: int, dtype: torch.dtype, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.randn(T, d // 2) * 3
    emb = torch.cat((ang, ang), -1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_ref_matches_model(dtype):
    norm = RMSNorm(48, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x, r = torch.randn(3, 5, 48).to(dtype), torch.randn(3, 5, 48).to(dtype)
    assert torch.equal(rms_norm_ref(x, norm.weight.detach(), 1e-6), norm(x).detach())
    y, s = rms_norm_ref(x, norm.weight.detach(), 1e-6, r)
    assert torch.equal(s, x + r) and torch.equal(y, norm(x + r).detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_ref_matches_model(dtype):
    q, k = torch.randn(6, 4, 32).to(dtype), torch.randn(6, 2, 32).to(dtype)
    cos, sin = _cos_sin(6, 32, dtype)
    qr, kr = rope_ref(q, k, cos, sin)
    assert torch.equal(qr, apply_rotary(q, cos, sin)) and torch.equal(kr, apply_rotary(k, cos, sin))


def _check_rms(dtype, wdtype, residual, shape, device="cpu"):
    x = torch.randn(*shape).to(dtype).to(device)
    w = torch.randn(shape[-1]).to(wdtype).to(device)
    r = torch.randn(*shape).to(dtype).to(device) if residual else None
    got, want = rms_norm(x, w, 1e-6, r, impl="triton"), rms_norm_ref(x, w, 1e-6, r)
    if residual:
        torch.testing.assert_close(got[1].float(), want[1].float(), atol=TOL[dtype], rtol=TOL[dtype])
        got, want = got[0], want[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype])


@needs_interpreter
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.bfloat16, torch.float32)])
def test_rms_norm_triton_interpreter(dtype, wdtype, residual):
    _check_rms(dtype, wdtype, residual, (3, 5, 48))


def _check_rope(dtype, d, hq, hkv, inplace=False, device="cpu"):
    q, k = torch.randn(7, hq, d).to(dtype).to(device), torch.randn(7, hkv, d).to(dtype).to(device)
    cos, sin = _cos_sin(7, d, dtype, device)
    want = rope_ref(q, k, cos, sin)
    got = rope(q.clone(), k.clone(), cos, sin, impl="triton", inplace=inplace)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hq,hkv", [(16, 2, 2), (32, 8, 1), (24, 6, 3)])
def test_rope_triton_interpreter(dtype, d, hq, hkv):
    _check_rope(dtype, d, hq, hkv)


@needs_interpreter
def test_rope_inplace():
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    cos, sin = _cos_sin(3, 16, torch.float32)
    want = rope_ref(q, k, cos, sin)
    for impl in ("ref", "triton"):
        q2, k2 = q.clone(), k.clone()
        rope(q2, k2, cos, sin, inplace=True, impl=impl)
        torch.testing.assert_close(q2, want[0]) and torch.testing.assert_close(k2, want[1])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_rope_triton_gpu(dtype):
    for residual in (False, True):
        _check_rms(dtype, dtype, residual, (4096, 1024), "cuda")
        _check_rms(dtype, dtype, residual, (4096, 16, 128), "cuda")  # q/k-norm over heads
    _check_rope(dtype, 128, 32, 8, device="cuda")
    _check_rope(dtype, 64, 16, 16, inplace=True, device="cuda")

"""KV-cache write by slot mapping: reference against a per-token loop, Triton kernel against the reference."""
from __future__ import annotations

import pytest
import torch

from kernels.dispatch import interpreting
from kernels.kv_cache import write_kv, write_kv_ref

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(T: int, hkv: int, d: int, block_size: int, num_blocks: int, src_dtype, cache_dtype, device="cpu"):
    g = torch.Generator().manual_seed(T * 31 + hkv)
    k = torch.randn(T, hkv, d, generator=g).to(src_dtype).to(device)
    v = torch.randn(T, hkv, d, generator=g).to(src_dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    assert slots.numel() == T
    slots[::3] = -1  # every third token is padding
    kc = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(cache_dtype).to(device)
    return k, v, kc, kc.clone() * 2, slots.to(device)


def test_write_kv_ref_matches_loop():
    k, v, kc, vc, slots = _case(7, 2, 16, 4, 5, torch.float32, torch.float32)
    want_k, want_v = kc.clone(), vc.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // 4, s % 4] = k[t]
            want_v[s // 4, s % 4] = v[t]
    write_kv_ref(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@needs_interpreter
@pytest.mark.parametrize("src,cache", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                       (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("hkv,d,block_size", [(1, 16, 1), (2, 32, 4), (3, 24, 16)])
def test_write_kv_triton_interpreter(src, cache, hkv, d, block_size):
    k, v, kc, vc, slots = _case(9, hkv, d, block_size, 12, src, cache)
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, slots, impl="triton")
    write_kv_ref(k, v, kc2, vc2, slots)
    if src == cache:
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    else:  # the interpreter rounds fp32 -> bf16 toward zero, torch to nearest: one ulp apart at most
        torch.testing.assert_close(kc.float(), kc2.float(), atol=0, rtol=2 ** -7)
        torch.testing.assert_close(vc.float(), vc2.float(), atol=0, rtol=2 ** -7)


@needs_interpreter
def test_write_kv_triton_strided_views():
    """k and v as views into a fused [T, 3, Hkv, D] projection output."""
    qkv = torch.randn(5, 3, 2, 16)
    kc, vc = torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.tensor([0, 5, -1, 11, 2])
    write_kv(qkv[:, 1], qkv[:, 2], kc, vc, slots, impl="triton")
    write_kv_ref(qkv[:, 1], qkv[:, 2], kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_kv_triton_gpu(dtype):
    k, v, kc, vc, slots = _case(4096, 8, 128, 16, 1024, dtype, dtype, "cuda")
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, slots)
    write_kv_ref(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)

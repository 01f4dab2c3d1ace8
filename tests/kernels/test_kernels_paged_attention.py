"""Paged decode and prefill/extend attention: references against dense attention, Triton kernels (CPU interpreter
on tiny shapes, CUDA at real sizes) against the references, and the dispatcher's choices."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.dispatch import HAS_TRITON, interpreting, use_triton
from kernels.paged_attention import paged_decode, paged_decode_ref, paged_prefill, paged_prefill_ref

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
needs_interpreter = pytest.mark.skipif(not interpreting(), reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
LENS = [1, 8, 13, 37]  # one token, a context ending exactly on a block boundary (block_size 4), ragged, longer


def make_cache(lens: list[int], hkv: int, d: int, block_size: int, dtype: torch.dtype, device: str = "cpu",
               seed: int = 0
               ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous per-sequence K/V ([n, Hkv, D] each) scattered into a paged cache with shuffled block ids.
    Returns (ks, vs, k_cache, v_cache, block_tables [B, max_blocks] int32, -1 padded)."""
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in lens]
    vs = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in lens]
    nblocks = [-(-n // block_size) for n in lens]
    total = sum(nblocks) + 3
    k_cache = torch.randn(total, block_size, hkv, d, generator=g).to(dtype)  # garbage where nothing is written
    v_cache = torch.randn(total, block_size, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(total, generator=g)
    tables = torch.full((len(lens), max(nblocks) + 1), -1, dtype=torch.int32)
    used = 0
    for b, (n, nb) in enumerate(zip(lens, nblocks)):
        tables[b, :nb] = perm[used:used + nb].int()
        used += nb
        for i in range(n):
            blk = int(tables[b, i // block_size])
            k_cache[blk, i % block_size] = ks[b][i]
            v_cache[blk, i % block_size] = vs[b][i]
    dev = torch.device(device)
    return ([k.to(dev) for k in ks], [v.to(dev) for v in vs], k_cache.to(dev), v_cache.to(dev), tables.to(dev))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, scale: float,
                    window: int | None) -> torch.Tensor:
    """Textbook softmax attention in fp64. q [M, Hq, D], k/v [n, Hkv, D]; query i sits at position qpos[i]."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), kk) * scale
    kpos = torch.arange(k.shape[0])
    ok = kpos[None, :] <= qpos[:, None]
    if window is not None:
        ok &= kpos[None, :] > qpos[:, None] - window
    s = s.masked_fill(~ok, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), vv)


# ---- references against dense attention --------------------------------------------------------------------

@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_ref_matches_dense(group, window):
    ks, vs, kc, vc, bt = make_cache(LENS, 2, 16, 4, torch.float32)
    q = torch.randn(len(LENS), 2 * group, 16)
    out = paged_decode_ref(q, kc, vc, bt, torch.tensor(LENS, dtype=torch.int32), 0.25, window)
    for b, n in enumerate(LENS):
        want = dense_attention(q[b:b + 1], ks[b], vs[b], torch.tensor([n - 1]), 0.25, window)[0]
        torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [None, 3])
def test_prefill_ref_matches_dense(group, window):
    ks, vs, kc, vc, bt = make_cache(LENS, 2, 16, 4, torch.float32)
    qlens = [1, 8, 5, 37]  # decode-like, whole sequence new, extend after a cached prefix, full prefill
    cu = torch.tensor([0] + qlens).cumsum(0).int()
    q = torch.randn(int(cu[-1]), 2 * group, 16)
    out = paged_prefill_ref(q, kc, vc, cu, torch.tensor(LENS, dtype=torch.int32), bt, 0.25, window)
    for b, (n, m) in enumerate(zip(LENS, qlens)):
        want = dense_attention(q[cu[b]:cu[b + 1]], ks[b], vs[b], torch.arange(n - m, n), 0.25, window)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]].double(), want, atol=1e-5, rtol=1e-5)


def test_decode_ref_empty_context_gives_zeros():
    _, _, kc, vc, bt = make_cache([4, 4], 1, 16, 4, torch.float32)
    out = paged_decode_ref(torch.randn(2, 2, 16), kc, vc, bt, torch.tensor([0, 4], dtype=torch.int32), 0.25)
    assert out[0].abs().max() == 0 and out[1].abs().max() > 0


# ---- Triton kernels against the references ------------------------------------------------------------------

def _check_decode(group, splits, window, dtype, lens=LENS, d=32, block_size=4, device="cpu", hkv=2, tol=None):
    _, _, kc, vc, bt = make_cache(lens, hkv, d, block_size, dtype, device)
    q = torch.randn(len(lens), hkv * group, d).to(dtype).to(device)
    cl = torch.tensor(lens, dtype=torch.int32, device=device)
    want = paged_decode_ref(q, kc, vc, bt, cl, d ** -0.5, window)
    got = paged_decode(q, kc, vc, bt, cl, d ** -0.5, window, impl="triton", num_splits=splits)
    atol = tol or (1e-5 if dtype == torch.float32 else 2e-2)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_triton_interpreter(group, splits, window, dtype):
    _check_decode(group, splits, window, dtype, d=16 if group in (1, 4) else 32)


@needs_interpreter
@pytest.mark.parametrize("block_size,d", [(1, 16), (16, 64), (4, 24)])
def test_decode_triton_block_sizes_and_head_dims(block_size, d):
    _check_decode(2, 2, None, torch.float32, lens=[1, 16, 21], d=d, block_size=block_size)


@needs_interpreter
def test_decode_triton_padding_sequence_and_more_splits_than_tiles():
    _check_decode(2, 8, None, torch.float32, lens=[0, 3, 40])


def _check_prefill(group, window, dtype, lens=LENS, qlens=(1, 8, 5, 37), d=32, block_size=4, device="cpu", hkv=2,
                   tol=None):
    _, _, kc, vc, bt = make_cache(lens, hkv, d, block_size, dtype, device)
    cu = torch.tensor([0] + list(qlens)).cumsum(0).int().to(device)
    q = torch.randn(int(cu[-1]), hkv * group, d).to(dtype).to(device)
    cl = torch.tensor(lens, dtype=torch.int32, device=device)
    want = paged_prefill_ref(q, kc, vc, cu, cl, bt, d ** -0.5, window)
    got = paged_prefill(q, kc, vc, cu, cl, bt, d ** -0.5, window, impl="triton")
    atol = tol or (1e-5 if dtype == torch.float32 else 2e-2)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_prefill_triton_interpreter(group, window, dtype):
    _check_prefill(group, window, dtype, d=16 if group in (1, 4) else 32)


@needs_interpreter
def test_prefill_triton_odd_group_and_block_size():
    _check_prefill(3, None, torch.float32, lens=[20, 30, 16], qlens=(20, 1, 9), block_size=16)


# ---- dispatch ---------------------------------------------------------------------------------------------------

def test_dispatch_picks_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("TIDAL_KERNELS", raising=False)
    t = torch.zeros(1)
    assert not use_triton(None, t) and not use_triton("auto", t) and not use_triton("ref", t)
    monkeypatch.setenv("TIDAL_KERNELS", "ref")
    assert not use_triton(None, t)
    with pytest.raises(ValueError):
        use_triton("cuda", t)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        use_triton("triton", t)


@needs_interpreter
def test_env_var_forces_triton(monkeypatch):
    import kernels.triton_ops.paged_attention as triton_pa
    calls = []
    monkeypatch.setattr(triton_pa, "paged_decode_triton", lambda *a, **k: calls.append(1) or paged_decode_ref(*a[:7]))
    _, _, kc, vc, bt = make_cache([5], 1, 16, 4, torch.float32)
    args = (torch.randn(1, 2, 16), kc, vc, bt, torch.tensor([5], dtype=torch.int32), 0.25)
    paged_decode(*args)
    assert calls == []
    monkeypatch.setenv("TIDAL_KERNELS", "triton")
    paged_decode(*args)
    assert calls == [1]


def _python(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter at the repo root, without TRITON_INTERPRET or TIDAL_KERNELS."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TIDAL_KERNELS")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


CPU_JOB = """
import sys
import torch
import engine, model, trainer, train  # everything the main job imports
from kernels.kv_cache import write_kv
k, kc, vc = torch.ones(1, 1, 4), torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4)
write_kv(k, k, kc, vc, torch.tensor([3]))  # "auto" on CPU: the reference
assert kc[1, 1].sum() == 4
"""


def test_without_triton_everything_imports_and_runs_the_references():
    """As on a machine without triton: the main job imports, "auto" runs the reference, forcing "triton" says why
    it cannot."""
    proc = _python('import sys\nsys.modules["triton"] = None  # every import of triton fails\n' + CPU_JOB
                   + 'write_kv(k, k, kc, vc, torch.tensor([3]), impl="triton")\n')
    assert "RuntimeError: impl='triton' but triton is not installed" in proc.stderr, proc.stderr


@needs_triton
def test_cpu_path_never_imports_triton_and_a_late_interpreter_switch_is_refused():
    """With triton installed and TRITON_INTERPRET unset the CPU path never imports triton; switching the
    interpreter on after triton was imported is refused with the reason, not an obscure launch failure."""
    proc = _python(CPU_JOB + """
assert "triton" not in sys.modules
import os
import triton
os.environ["TRITON_INTERPRET"] = "1"
write_kv(k, k, kc, vc, torch.tensor([3]), impl="triton")
""")
    assert "TRITON_INTERPRET is set but triton was imported while it was unset" in proc.stderr, proc.stderr


@needs_triton
def test_split_heuristic():
    from kernels.triton_ops.paged_attention import choose_num_splits
    assert choose_num_splits(64, 8, 16384, 132) == 1  # 512 programs already fill an H200
    assert choose_num_splits(4, 8, 16384, 132) == 8  # 32 programs: split long contexts
    assert choose_num_splits(1, 8, 1000, 132) == 2  # but never below MIN_TOKENS_PER_SPLIT per split
    assert choose_num_splits(1, 8, 200, 132) == 1


# ---- GPU: the same grids at real sizes ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("splits", [1, 4, None])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.gpu
@requires_cuda
def test_decode_triton_gpu(group, splits, window, dtype, d):
    _check_decode(group, splits, window, dtype, lens=[1, 16, 257, 1000, 2048, 3001], d=d, block_size=16,
                  device="cuda", hkv=4, tol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.gpu
@requires_cuda
def test_prefill_triton_gpu(group, window, dtype, d):
    _check_prefill(group, window, dtype, lens=[1, 16, 700, 1500], qlens=(1, 16, 200, 1500), d=d, block_size=16,
                   device="cuda", hkv=4, tol=2e-2)


@pytest.mark.gpu
@requires_cuda
def test_prefill_auto_gpu_matches_reference():
    """impl="auto" on CUDA: flash-attn where it applies (block_size 256), else the Triton kernel."""
    for bs in (16, 256):
        _, _, kc, vc, bt = make_cache([300, 1000], 4, 128, bs, torch.bfloat16, "cuda")
        cu = torch.tensor([0, 300, 400], dtype=torch.int32, device="cuda")
        q = torch.randn(400, 16, 128, dtype=torch.bfloat16, device="cuda")
        cl = torch.tensor([300, 1000], dtype=torch.int32, device="cuda")
        want = paged_prefill_ref(q, kc, vc, cu, cl, bt, 0.088)
        torch.testing.assert_close(paged_prefill(q, kc, vc, cu, cl, bt, 0.088).float(), want.float(),
                                   atol=2e-2, rtol=2e-2)


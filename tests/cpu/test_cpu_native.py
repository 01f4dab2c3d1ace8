"""The C paged-attention kernel of the CPU engine (cpu/attention.py) against the PyTorch references: decode,
prefill chunks over cached prefixes, mixed rows; the head dims it specialises and any other; NaN propagation;
batch independence; bad tables raising instead of crashing; the build cache and the fallback without a compiler."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpu import attention as cpu_attention
from cpu import build as cpu_build
from kernels.paged_attention import paged_decode_ref, paged_prefill_ref

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not cpu_attention.native_available(),
                                reason=f"no C compiler: {cpu_attention.unavailable_reason()}")


def pool(seed: int, ctx: list[int], Hkv: int, D: int, bs: int, spare: int = 5):
    """Random K/V pool and a block table giving each sequence its own shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in ctx]
    nblocks = sum(need) + spare
    kc, vc = torch.randn(nblocks, bs, Hkv, D, generator=g), torch.randn(nblocks, bs, Hkv, D, generator=g)
    perm = torch.randperm(nblocks, generator=g)
    width = max(need) + 1
    bt = torch.full((len(ctx), width), nblocks - 1, dtype=torch.int32)  # unused entries: some valid id
    used = 0
    for b, k in enumerate(need):
        bt[b, :k] = perm[used:used + k]
        used += k
    return g, kc, vc, bt, torch.tensor(ctx, dtype=torch.int32)


SHAPES = [  # (Hq, Hkv, D, block size): GQA groups 1/2/4, the specialised head dims 16, 32, 64 and 128, a generic
    # one that is a multiple of 8 (vector path, runtime D) and one that is not (scalar path)
    (4, 2, 64, 16), (8, 2, 128, 4), (4, 4, 24, 1), (6, 3, 64, 5), (2, 1, 128, 16), (4, 2, 16, 16), (4, 1, 32, 3),
    (2, 2, 40, 7)]


@pytest.mark.parametrize("Hq,Hkv,D,bs", SHAPES)
def test_decode_matches_reference(Hq, Hkv, D, bs):
    g, kc, vc, bt, ctx = pool(0, [1, 7, 16, 33, bs, 100], Hkv, D, bs)
    q = torch.randn(len(ctx), Hq, D, generator=g)
    ref = paged_decode_ref(q, kc, vc, bt, ctx, D ** -0.5)
    out = cpu_attention.paged_decode_native(q, kc, vc, bt, ctx, D ** -0.5)
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("Hq,Hkv,D,bs", SHAPES)
def test_prefill_over_cached_prefixes_matches_reference(Hq, Hkv, D, bs):
    g, kc, vc, bt, ctx = pool(1, [9, 7, 40, 3, 64], Hkv, D, bs)
    q_lens = torch.tensor([9, 2, 17, 1, 64])  # whole prompts, extensions of cached prefixes, one token
    cu = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), Hq, D, generator=g)
    ref = paged_prefill_ref(q, kc, vc, cu, ctx, bt, 0.3)
    assert (cpu_attention.paged_prefill_native(q, kc, vc, cu, ctx, bt, 0.3) - ref).abs().max() < 1e-5


def test_mixed_rows_in_one_call_match_decode_and_prefill():
    """A step's decode rows and prefill chunk in one call (what the engine does) equal the two references."""
    g, kc, vc, bt, ctx = pool(2, [20, 5, 30, 12], 2, 64, 4)
    nd, q_lens = 2, torch.tensor([6, 12])  # sequences 0, 1 decode; 2, 3 prefill their last 6 / all 12 tokens
    q = torch.randn(nd + int(q_lens.sum()), 4, 64, generator=g)
    cu = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    pseq, plen = cpu_attention.prefill_rows(cu, ctx[nd:])
    rows_seq = torch.cat([torch.arange(nd), pseq + nd])
    rows_len = torch.cat([ctx[:nd].long(), plen])
    out = cpu_attention.paged_attention_native(q, kc, vc, bt, rows_seq, rows_len, 0.125)
    ref = torch.cat([paged_decode_ref(q[:nd], kc, vc, bt[:nd], ctx[:nd], 0.125),
                     paged_prefill_ref(q[nd:], kc, vc, cu, ctx[nd:], bt[nd:], 0.125)])
    assert (out - ref).abs().max() < 1e-5


def test_a_row_does_not_depend_on_its_batch():
    g, kc, vc, bt, ctx = pool(3, [50, 3, 77, 18], 2, 64, 16)
    q = torch.randn(4, 4, 64, generator=g)
    together = cpu_attention.paged_decode_native(q, kc, vc, bt, ctx, 0.125)
    for b in range(4):
        alone = cpu_attention.paged_decode_native(q[b:b + 1], kc, vc, bt[b:b + 1], ctx[b:b + 1], 0.125)
        assert torch.equal(alone[0], together[b])


@pytest.mark.parametrize("bs", [4, 16])   # 16: the bad token is scored in a group of 8 (the AVX path)
def test_nan_in_a_sequence_poisons_only_that_sequence(bs):
    g, kc, vc, bt, ctx = pool(4, [10, 10, 10], 2, 64, bs)
    kc[bt[1, 6 // bs], 6 % bs, 0, 5] = float("nan")  # a K entry of sequence 1 (position 6, kv head 0)
    q = torch.randn(3, 4, 64, generator=g)
    out = cpu_attention.paged_decode_native(q, kc, vc, bt, ctx, 0.125)
    assert torch.isnan(out[1]).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all()
    # a context that has not reached the bad token is unaffected
    out = cpu_attention.paged_decode_native(q, kc, vc, bt, torch.tensor([10, 6, 10], dtype=torch.int32), 0.125)
    assert torch.isfinite(out).all()


def test_empty_context_gives_zeros_and_empty_batch_works():
    g, kc, vc, bt, ctx = pool(5, [4, 8], 2, 64, 4)
    q = torch.randn(2, 4, 64, generator=g)
    out = cpu_attention.paged_decode_native(q, kc, vc, bt, torch.tensor([0, 8], dtype=torch.int32), 0.125)
    assert torch.equal(out[0], torch.zeros(4, 64))
    assert cpu_attention.paged_decode_native(q[:0], kc, vc, bt[:0], ctx[:0], 0.125).shape == (0, 4, 64)


def test_bad_tables_and_tensors_raise():
    g, kc, vc, bt, ctx = pool(6, [8, 8], 2, 64, 4)
    q = torch.randn(2, 4, 64, generator=g)
    bad = bt.clone()
    bad[1, 0] = kc.shape[0]  # one past the pool
    with pytest.raises(IndexError, match="outside"):
        cpu_attention.paged_decode_native(q, kc, vc, bad, ctx, 0.1)
    bad[1, 0] = -1
    with pytest.raises(IndexError):
        cpu_attention.paged_decode_native(q, kc, vc, bad, ctx, 0.1)
    with pytest.raises(IndexError):  # a row naming a sequence the table does not have
        cpu_attention.paged_attention_native(q, kc, vc, bt, torch.tensor([0, 2]), ctx, 0.1)
    with pytest.raises(IndexError):  # a context longer than the table row can hold
        cpu_attention.paged_decode_native(q, kc, vc, bt, torch.tensor([8, 4 * bt.shape[1] + 1]), 0.1)
    with pytest.raises(ValueError, match="fp32"):
        cpu_attention.paged_decode_native(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), bt, ctx, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        cpu_attention.paged_decode_native(torch.randn(2, 4, 32), kc, vc, bt, ctx, 0.1)


def test_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    path = cpu_build.build()
    assert path.parent == tmp_path and path.exists()
    mtime = path.stat().st_mtime_ns
    assert cpu_build.build() == path and path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_a_header_the_source_includes_is_part_of_the_cache_key(tmp_path, monkeypatch):
    """The kernels share cpu/csrc/exp_nonpos.h: an edited header must rebuild them, not reuse a stale object."""
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "k.c"
    src.write_text('#include "k.h"\nint f(void) { return K; }\n')
    (tmp_path / "k.h").write_text("#define K 1\n")
    first = cpu_build.build(source=src)
    (tmp_path / "k.h").write_text("#define K 2\n")
    second = cpu_build.build(source=src)
    assert first != second and first.exists() and second.exists()


def test_without_a_compiler_the_engine_falls_back_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu_attention.PAGED, "lib", None)
    monkeypatch.setattr(cpu_attention.PAGED, "error", None)
    with pytest.warns(UserWarning, match="batched PyTorch path"):
        assert not cpu_attention.native_available()
    assert "no-such-cc" in cpu_attention.unavailable_reason()
    from cpu.attention import CpuPagedAttention as PagedAttention
    kc = [torch.zeros(4, 4, 2, 8)]
    assert not PagedAttention(kc, kc, 0.1, "auto").native
    with pytest.raises(RuntimeError, match="no-such-cc"):
        PagedAttention(kc, kc, 0.1, "native")


def test_a_failing_compile_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "CFLAGS", cpu_build.CFLAGS + ["-DPAGED_ATTENTION_BROKEN", "-include",
                                                                   str(tmp_path / "missing.h")])
    with pytest.raises(RuntimeError, match="missing.h"):
        cpu_build.build()
    assert list(tmp_path.iterdir()) == []


def test_ranks_building_at_once_compile_once(tmp_path):
    """The ranks of a job start together with an empty cache: one compiles each source, the others wait for its
    object (a compiler that logs its calls, four processes building the same source at once)."""
    cc = tmp_path / "cc"
    real = cpu_build._compiler()
    cc.write_text(f"#!/bin/sh\necho call >> {tmp_path / 'calls'}\nsleep 1\nexec {real} \"$@\"\n")
    cc.chmod(0o755)
    env = {**os.environ, "CC": str(cc), "TIDAL_CACHE_DIR": str(tmp_path / "cache")}
    code = "from cpu import build; print(build.build(source=build.SOURCE.parent / 'sample.c'))"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and len(set(outs)) == 1 and Path(outs[0]).exists()
    assert (tmp_path / "calls").read_text().split() == ["call"]

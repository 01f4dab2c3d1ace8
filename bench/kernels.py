"""Kernel benchmarks: every number is a ratio against a peer measured in the same run.

    python -m bench.kernels            (or: python bench/kernels.py)

On CUDA (the issue's sizes, bf16):
- paged decode, batch 64, contexts 1k/4k/16k, Qwen3-0.6B heads (16 q / 8 kv / 128) and Qwen3-8B heads (32 / 8 / 128):
  achieved bandwidth (K/V + q + block tables read, out written, over the time) as a fraction of the device's copy
  bandwidth (a large `copy_`, read + write), and the speedup over batched PyTorch gather + SDPA; plus batch 8 at
  16k with and without KV splits;
- chunked logprob + entropy (forward + backward), 16k tokens, vocabulary 151,936, hidden 1024: time and peak memory
  against naive `log_softmax(hidden @ W.T)`, and against our own chunked path without the Triton row kernels;
- RMSNorm + residual and RoPE against their PyTorch references.
On CPU the Triton kernels cannot run (the interpreter is a test tool, hundreds of times slower), so the same lines
compare the PyTorch reference paths against naive baselines at small sizes, and say so.
The last line is the headline ratio.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: bench/ would shadow the kernels package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cpu  # noqa: E402
from kernels.logprobs import token_logprobs, token_logprobs_naive  # noqa: E402
from kernels.memtrack import LiveBytes  # noqa: E402
from kernels.paged_attention import paged_decode  # noqa: E402
from kernels.rmsnorm import rms_norm  # noqa: E402
from kernels.rope import rope  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


def seconds(fn: Callable[[], object], reps: int = 5) -> float:
    """Median seconds per call: triton's do_bench (CUDA events, L2 flushed) on GPU, perf_counter on CPU."""
    if CUDA:
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    fn()  # warmup
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_bytes(fn: Callable[[], object]) -> int:
    """Extra memory at peak while fn runs (CUDA allocator stats on GPU, kernels.memtrack on CPU)."""
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with LiveBytes() as meter:
        fn()
    return meter.peak


def copy_bandwidth(nbytes: int) -> float:
    """Bytes per second of dst.copy_(src), counting the read and the write."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16 if CUDA else torch.float16, device=DEV).fill_(1)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / seconds(lambda: dst.copy_(src))


def gather_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, ctx: int,
                scale: float) -> torch.Tensor:
    """The PyTorch peer for equal-length contexts: gather every sequence's blocks, then one batched SDPA."""
    B, (_, _, Hkv, D) = q.shape[0], k_cache.shape
    nb = -(-ctx // k_cache.shape[1])
    k = k_cache[block_tables[:, :nb].long()].view(B, -1, Hkv, D)[:, :ctx].transpose(1, 2)
    v = v_cache[block_tables[:, :nb].long()].view(B, -1, Hkv, D)[:, :ctx].transpose(1, 2)
    o = F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)
    return o[:, :, 0]


def bench_decode(label: str, hq: int, hkv: int, d: int, batch: int, ctx: int, bw: float, dtype: torch.dtype,
                 block_size: int = 16, num_splits: int | None = None) -> float:
    """One decode configuration; prints a line and returns achieved bandwidth / copy bandwidth."""
    nb = -(-ctx // block_size)
    k_cache = torch.randn(batch * nb + 1, block_size, hkv, d, device=DEV, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(batch * nb, device=DEV)[: batch * nb].view(batch, nb) + 1).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, hq, d, device=DEV, dtype=dtype)
    scale = d ** -0.5
    ours = seconds(lambda: paged_decode(q, k_cache, v_cache, tables, lens, scale, num_splits=num_splits))
    peer = seconds(lambda: gather_sdpa(q, k_cache, v_cache, tables, ctx, scale))
    elt = k_cache.element_size()
    moved = 2 * batch * ctx * hkv * d * elt + 2 * q.numel() * elt + tables.numel() * 4 + lens.numel() * 4
    frac = moved / ours / bw
    what = "triton" if CUDA else "reference (per-sequence gather + SDPA)"
    split = f" splits={num_splits}" if num_splits is not None else ""
    print(f"decode {label} B={batch} ctx={ctx}{split}: {what} {ours * 1e6:.0f} us, {moved / ours / 1e9:.1f} GB/s "
          f"= {frac:.2f}x copy bw; batched gather+SDPA {peer * 1e6:.0f} us -> {peer / ours:.2f}x")
    return frac


def bench_logprobs(T: int, V: int, H: int, dtype: torch.dtype, chunk: int | None = None
                   ) -> dict[str, tuple[float, float]]:
    """Prints a line per path; returns {path: (seconds, peak extra bytes)}."""
    h = torch.randn(T, H, device=DEV, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, H, device=DEV, dtype=dtype) / math.sqrt(H)).requires_grad_()
    t = torch.randint(0, V, (T,), device=DEV)

    def fwd_bwd(fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
        def run() -> None:
            lp, ent = fn()
            torch.autograd.grad(lp.sum() + ent.sum(), (h, w))
        return run

    paths = {"chunked (auto)": lambda: token_logprobs(h, w, t, chunk_size=chunk),
             "chunked (torch only)": lambda: token_logprobs(h, w, t, chunk_size=chunk, impl="ref"),
             "naive log_softmax": lambda: token_logprobs_naive(h, w, t)}
    if not CUDA:
        del paths["chunked (torch only)"]  # on CPU "auto" already is the torch path
    res = {}
    for name, fn in paths.items():
        try:
            res[name] = (seconds(fwd_bwd(fn), reps=3), peak_bytes(fwd_bwd(fn)))
        except torch.OutOfMemoryError:
            res[name] = (math.inf, math.inf)
        print(f"logprobs T={T} V={V} H={H} {str(dtype)[6:]} fwd+bwd {name}: {res[name][0] * 1e3:.1f} ms, "
              f"peak extra {res[name][1] / 2 ** 20:.0f} MiB")
    ours, naive = res["chunked (auto)"], res["naive log_softmax"]
    print(f"logprobs_vs_naive: speed {naive[0] / ours[0]:.2f}x, peak memory {naive[1] / ours[1]:.1f}x smaller")
    if "chunked (torch only)" in res:
        print(f"logprobs_triton_rows_vs_torch_rows: {res['chunked (torch only)'][0] / ours[0]:.2f}x")
    return res


def bench_norm_rope(dtype: torch.dtype) -> None:
    """GPU only: fused kernels against the PyTorch references (both forward, engine-side)."""
    x, r = (torch.randn(8192, 1024, device=DEV, dtype=dtype) for _ in range(2))
    w = torch.randn(1024, device=DEV, dtype=dtype)
    tk = seconds(lambda: rms_norm(x, w, 1e-6, r))
    tr = seconds(lambda: rms_norm(x, w, 1e-6, r, impl="ref"))
    print(f"rms_norm+residual 8192x1024: triton {tk * 1e6:.0f} us, torch {tr * 1e6:.0f} us -> {tr / tk:.2f}x")
    q, k = torch.randn(8192, 32, 128, device=DEV, dtype=dtype), torch.randn(8192, 8, 128, device=DEV, dtype=dtype)
    cos, sin = torch.randn(8192, 128, device=DEV, dtype=dtype), torch.randn(8192, 128, device=DEV, dtype=dtype)
    tk = seconds(lambda: rope(q, k, cos, sin))
    tr = seconds(lambda: rope(q, k, cos, sin, impl="ref"))
    print(f"rope 8192 tokens 32q/8kv x 128: triton {tk * 1e6:.0f} us, torch {tr * 1e6:.0f} us -> {tr / tk:.2f}x")


def main() -> None:
    cpu.enable()   # the C kernels for fp32 CPU tensors (cpu/), as the entry points run them
    torch.manual_seed(0)
    if CUDA:
        print(f"device: {torch.cuda.get_device_name()}; Triton kernels vs PyTorch peers, bf16")
        bw = copy_bandwidth(4 << 30)
        dtype, batch, contexts = torch.bfloat16, 64, (1024, 4096, 16384)
    else:
        print("device: CPU. The Triton kernels need a GPU: the lines below time the PyTorch REFERENCE paths against "
              "naive baselines at small sizes, not the kernels.")
        bw = copy_bandwidth(256 << 20)
        dtype, batch, contexts = torch.float32, 4, (256, 1024, 4096)
    print(f"copy bandwidth: {bw / 1e9:.1f} GB/s")
    headline = {}
    for label, hq, hkv in (("qwen3-0.6b", 16, 8), ("qwen3-8b", 32, 8)):
        for ctx in contexts:
            headline[(label, ctx)] = bench_decode(label, hq, hkv, 128, batch, ctx, bw, dtype)
    if CUDA:
        for splits in (1, None):  # small batch, long context: what flash-decoding's split buys
            bench_decode("qwen3-0.6b", 16, 8, 128, 8, 16384, bw, dtype, num_splits=splits)
        bench_logprobs(16384, 151_936, 1024, dtype)
        bench_norm_rope(dtype)
    else:
        bench_logprobs(512, 32_768, 256, dtype, chunk=64)
    name = "paged_decode_4k_vs_copy_bw" if CUDA else "paged_decode_ref_4k_vs_copy_bw"
    ctx = 4096
    print(f"{name}: {headline[('qwen3-0.6b', ctx)]:.2f}x")


if __name__ == "__main__":
    main()

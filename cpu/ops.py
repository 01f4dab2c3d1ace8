"""Fused MLP, SwiGLU, RMSNorm and rotary embedding on the CPU in fp32: autograd functions over the C kernels of
`cpu/csrc/train_ops.c` for the trainer (cpu/trainer.py registers them into trainer/fused.py), and forward-only
versions for the engine (registered into the dispatchers of kernels/ by `cpu.enable`). Built and cached by
cpu/build.py.

Eager PyTorch computes `silu(g) * u` as two passes forward and four backward (keeping silu(g) alive in between),
RMSNorm's backward as about six, the rotary embedding as four each way; on a CPU those element-wise passes over
[tokens, intermediate] activations are memory-bound, about a fifth of a small model's train step. Each function
here makes one pass each way, keeps only its inputs (and RMSNorm's per-row 1/rms) for backward, and gives the same
values as the eager formulas to fp32 rounding (tests/cpu/test_cpu_train.py; the sigmoid uses the kernels' exp
polynomial, relative error ~2e-7). Results do not depend on the thread count (see the C file).

The whole MLP (`mlp`) goes further: its [tokens, intermediate] activations never reach memory. It runs a block of
MLP_ROWS rows at a time through the projections (torch's own sgemm) and SwiGLU while they sit in cache, and
recomputes the gate/up output in backward. The long vs-TRL job's MLP (17,408 rows x 64 -> 2 x 256 -> 64, one
thread) took 55-58 ms forward + backward a micro-batch unfused and 43-46 ms this way, the job's train step
0.98-1.04 -> 0.86-0.93 s (bench/results/cpu-vs-trl.md).

Only fp32 CPU tensors take these paths (`fused(x)`); anything else, or a build failure, keeps the eager ops
(trainer/fused.py and kernels/dispatch.py decide per call).
"""
from __future__ import annotations

import ctypes

import torch

from cpu import build
from kernels.rope import rope_ref

SOURCE = build.CSRC / "train_ops.c"
CHUNK = 512  # rows per partial sum of RMSNorm's weight gradient (fixed: results independent of threads)
MLP_ROWS = 256  # rows of the MLP computed at a time: their [rows, 3 x intermediate] floats stay in a core's cache

_P, _I, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
TRAIN_OPS = build.NativeLibrary(SOURCE, {
    "swiglu_fwd": ([_P, _P, _P, _I, _T], None),
    "swiglu_bwd": ([_P, _P, _P, _P, _P, _I, _T], None),
    "mlp_fwd": ([_P] * 7 + [_I] * 5 + [_T], None),
    "mlp_bwd": ([_P] * 13 + [_I] * 5 + [_T], None),
    "rmsnorm_fwd": ([_P, _P, _P, _P, _I, _I, ctypes.c_float, _T], None),
    "rmsnorm_bwd": ([_P, _P, _P, _P, _P, _P, _I, _I, _I, _T], None),
    "rope_fwd": ([_P, _P, _P, _P, _I, _I, _I, _T], None),
    "rope_bwd": ([_P, _P, _P, _P, _I, _I, _I, _T], None),
    "rmsnorm_infer": ([_P, _P, _P, _P, _P, _I, _I, ctypes.c_float, _T], None),
    "rope_inplace": ([_P, _P, _P, _I, _I, _I, _T], None),
}, "the eager ops run instead")


def available() -> bool:
    return TRAIN_OPS.load() is not None


def unavailable_reason() -> str | None:
    TRAIN_OPS.load()
    return TRAIN_OPS.error


def fused(*tensors: torch.Tensor) -> bool:
    """Whether these tensors take the fused path: fp32 on the CPU, with the kernels built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and available()


def _kernels() -> ctypes.CDLL:
    return TRAIN_OPS.require()


def mlp_available() -> bool:
    """Whether `mlp` can run: the kernels built and torch's sgemm found (`fused` tensors assumed)."""
    return available() and build.sgemm_address() is not None


def _sgemm() -> int:
    addr = build.sgemm_address()
    if addr is None:
        raise RuntimeError("mlp: torch's CPU library exports no sgemm_ (a build without MKL); use the unfused MLP")
    return addr


def _threads() -> int:
    return torch.get_num_threads()


class SwiGLU(torch.autograd.Function):
    """silu(g) * u."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if g.shape != u.shape:
            raise ValueError(f"swiglu: gate {tuple(g.shape)} and up {tuple(u.shape)} differ")
        g, u = g.contiguous(), u.contiguous()
        h = torch.empty_like(g)
        _kernels().swiglu_fwd(g.data_ptr(), u.data_ptr(), h.data_ptr(), g.numel(), _threads())
        ctx.save_for_backward(g, u)
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, u = ctx.saved_tensors
        dh = dh.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        _kernels().swiglu_bwd(g.data_ptr(), u.data_ptr(), dh.data_ptr(), dg.data_ptr(), du.data_ptr(), g.numel(),
                              _threads())
        return dg, du


class MLP(torch.autograd.Function):
    """down(silu(x gate^T) * (x up^T)) in one C call each way (train_ops.c `mlp_fwd` / `mlp_bwd`), MLP_ROWS rows at a
    time: a block's gate/up output, its SwiGLU and the down projection's input stay in cache between the matmuls,
    where the unfused MLP writes [tokens, intermediate] tensors three times to memory and reads them back. The
    projections are torch's own BLAS sgemm (build.sgemm_address). Only x is kept for backward (the gate/up
    output is recomputed block by block: cheaper than keeping it in memory). The weight gradients are sums over
    blocks in a fixed order (results do not depend on the thread count); same values as the unfused MLP to fp32
    rounding."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
        H, (O, I) = x.shape[-1], wd.shape
        if wg.shape != (I, H) or wu.shape != (I, H) or wd.dim() != 2:
            raise ValueError(f"mlp: input rows of {H} with gate {tuple(wg.shape)}, up {tuple(wu.shape)}, "
                             f"down {tuple(wd.shape)}")
        x2, wd = x.reshape(-1, H).contiguous(), wd.contiguous()
        T, n = x2.shape[0], min(x2.shape[0], MLP_ROWS)
        wgu_t = torch.cat([wg, wu]).t().contiguous()   # [H, 2I]: gate and up in one matmul a block
        y, gu, h = x2.new_empty(T, O), x2.new_empty(n, 2 * I), x2.new_empty(n, I)   # gu, h: one block's scratch
        _kernels().mlp_fwd(_sgemm(), x2.data_ptr(), wgu_t.data_ptr(), wd.data_ptr(), y.data_ptr(), gu.data_ptr(),
                           h.data_ptr(), T, H, I, O, MLP_ROWS, _threads())
        ctx.save_for_backward(x2, wg, wu, wd)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], O)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x2, wg, wu, wd = ctx.saved_tensors
        (T, H), (O, I) = x2.shape, wd.shape
        dy2 = dy.reshape(T, O).contiguous()
        wgu = torch.cat([wg, wu])
        wgu_t = wgu.t().contiguous()
        dx, dwgu, dwd = x2.new_empty(T, H), x2.new_empty(2 * I, H), x2.new_empty(O, I)
        n = min(T, MLP_ROWS)
        scratch = [x2.new_empty(n, 2 * I), x2.new_empty(n, I), x2.new_empty(n, I), x2.new_empty(n, 2 * I)]
        _kernels().mlp_bwd(_sgemm(), x2.data_ptr(), wgu.data_ptr(), wgu_t.data_ptr(), wd.data_ptr(), dy2.data_ptr(),
                           dx.data_ptr(), dwgu.data_ptr(), dwd.data_ptr(), *(t.data_ptr() for t in scratch),
                           T, H, I, O, MLP_ROWS, _threads())
        return dx.view(ctx.shape), dwgu[:I], dwgu[I:], dwd


class RMSNorm(torch.autograd.Function):
    """weight * x / rms(x) over the last dim (model.transformer.RMSNorm's fp32 math)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        D = x.shape[-1]
        if weight.shape != (D,):
            raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for rows of {D}")
        x, weight = x.contiguous(), weight.contiguous()   # rows of D, end to end
        n = x.numel() // D if D else 0
        y, rstd = torch.empty_like(x), x.new_empty(n)      # y is no view (FSDP2 warns of a module output that is)
        _kernels().rmsnorm_fwd(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), n, D, float(eps),
                               _threads())
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        D, n = x.shape[-1], rstd.numel()
        dy = dy.contiguous()
        dx, part = torch.empty_like(x), x.new_empty(max(1, -(-n // CHUNK)), D)
        _kernels().rmsnorm_bwd(x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), dy.data_ptr(), dx.data_ptr(),
                               part.data_ptr(), n, D, CHUNK, _threads())
        if n == 0:
            part.zero_()
        return dx, part.sum(0), None


class Rotary(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin (model.rope.apply_rotary): x [T, H, D], cos and sin [T, D], constants."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T, H, D = x.shape
        if cos.shape != (T, D) or sin.shape != (T, D) or D % 2:
            raise ValueError(f"rotary: x {tuple(x.shape)} with cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        out = torch.empty_like(x)
        _kernels().rope_fwd(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), T, H, D, _threads())
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        dy = dy.contiguous()
        T, H, D = dy.shape
        dx = torch.empty_like(dy)
        _kernels().rope_bwd(dy.data_ptr(), cos.data_ptr(), sin.data_ptr(), dx.data_ptr(), T, H, D, _threads())
        return dx, None, None


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return SwiGLU.apply(g, u)


def mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The Qwen3 MLP, down_proj(silu(gate_proj(x)) * up_proj(x)), from the three projections' weights."""
    return MLP.apply(x, gate, up, down)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNorm.apply(x, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return Rotary.apply(x, cos, sin)


# Forward only, no autograd (the engine's CPU path, through the dispatchers of kernels/rmsnorm.py, rope.py and
# swiglu.py, and engine/fused.py's C family): fp32 CPU tensors, contiguous rows.

def rms_norm_infer(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * x / rms(x), or with a residual (y, x + residual) with y the norm of the sum."""
    D = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    s = None
    if residual is not None:
        residual = residual.contiguous()
        s = torch.empty_like(x)
    _kernels().rmsnorm_infer(x.data_ptr(), None if s is None else residual.data_ptr(), weight.contiguous().data_ptr(),
                             y.data_ptr(), None if s is None else s.data_ptr(), x.numel() // D if D else 0, D,
                             float(eps), _threads())
    return y if s is None else (y, s)


def rotary_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (contiguous) rotated in place by cos, sin [T, D]; returns x."""
    T, H, D = x.shape
    if not x.is_contiguous() or cos.shape != (T, D) or sin.shape != (T, D) or D % 2:
        raise ValueError(f"rotary_inplace: x {tuple(x.shape)} (contiguous: {x.is_contiguous()}) with cos "
                         f"{tuple(cos.shape)}, sin {tuple(sin.shape)}")
    _kernels().rope_inplace(x.data_ptr(), cos.contiguous().data_ptr(), sin.contiguous().data_ptr(), T, H, D,
                            _threads())
    return x


def silu_mul_infer(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    g, u = g.contiguous(), u.contiguous()
    h = torch.empty_like(g)
    _kernels().swiglu_fwd(g.data_ptr(), u.data_ptr(), h.data_ptr(), g.numel(), _threads())
    return h


def rope_infer(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inplace: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/rope.py's contract on fp32 CPU tensors: rotated copies, or q and k rotated in place (the reference's
    values copied in where they are not contiguous)."""
    if not inplace:
        q, k = q.clone(memory_format=torch.contiguous_format), k.clone(memory_format=torch.contiguous_format)
    elif not (q.is_contiguous() and k.is_contiguous()):
        qr, kr = rope_ref(q, k, cos, sin)
        return q.copy_(qr), k.copy_(kr)
    return rotary_inplace(q, cos, sin), rotary_inplace(k, cos, sin)


# What `cpu.enable` registers into kernels/dispatch.py: each calls this module's function by name at call time.

def rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    return rms_norm_infer(x, weight, eps, residual)


def rope_impl(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False):
    return rope_infer(q, k, cos, sin, inplace=inplace)


def silu_mul_impl(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu_mul_infer(gate, up)

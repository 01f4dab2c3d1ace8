"""Triton forward + backward of the trainer's element-wise ops on CUDA, as autograd functions: RMSNorm, SwiGLU's
silu(gate) * up and the rotary embedding (the engine's kernels beside this file are forward-only).

Why: eager PyTorch runs each of these as a chain of memory-bound kernels over the activations, each reading and
writing them again. RMSNorm in bf16 is seven forward (cast, pow, mean, add + rsqrt, mul, cast, mul) and about twice
that backward, the rotary embedding five per tensor each way, silu * up two forward and four backward. A train
step of the Qwen3-1.7B bench on an H200 (torch.profiler, bench/results/h200-2026-11-27/train-profile-3870a88.txt)
spent more CUDA time in element-wise kernels (mul 16%, copy 12%, add 6%, sum 3%, ...) than in its matmuls (37%).
Here each op is one kernel each way, keeps only its inputs (and RMSNorm's per-row 1 / rms) for backward, and
computes in fp32 inside.

Math, that of the eager modules (model/transformer.py, model/rope.py), with the same roundings forward:
  * RMSNorm: y = w * round(x * rstd), rstd = 1 / sqrt(mean(x^2) + eps) in fp32, round() to x's dtype, y in
    promote(w, x). Backward (the rounding passed through, as autograd's cast does): with xh = x * rstd and
    g = dy * w, dx = rstd * (g - xh * mean(g * xh)); dw = sum over rows of dy * round(xh) (fp32 partial sums
    per program, then one sum).
  * SwiGLU: h = round(round(silu(g)) * u). Backward: du = dh * round(silu(g)), dg = dh * u * silu'(g) with
    silu'(g) = sig(g) (1 + g (1 - sig(g))); the sigmoid from exp(-|g|), which cannot overflow.
  * Rotary: the kernel of kernels/triton_ops/rope.py forward; backward rotates the gradient back
    (dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1), cos and sin being constants.
The eager backward rounds every intermediate to bf16; these round once, so gradients agree to bf16 rounding
(tests/kernels/test_train_kernels.py, under TRITON_INTERPRET=1 on CPU and on CUDA).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_ops.paged_attention import device_sms
from kernels.triton_ops.rope import _rope_one
from kernels.triton_ops.swiglu import silu_mul_triton

TILE = 4096  # elements of a [rows, D] tile a program holds (fp32 inside): rows per tile = TILE // D, at least one


def _tile(D: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for rows of D."""
    block_d = triton.next_power_of_2(max(D, 1))
    block_r = max(1, TILE // block_d)
    return block_r, block_d, 8 if block_r * block_d >= 4096 else 4


@triton.jit
def _rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, N, D, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    r_ok = rows < N
    mask = r_ok[:, None] & (cols < D)[None, :]
    offs = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    h = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (w[None, :] * h).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=r_ok)


@triton.jit
def _rms_norm_bwd(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_ptr, N, D, rows_per_program,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [pid * rows_per_program, ...) tile by tile; this program's part of dw to dw_ptr[pid]."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    c_ok = cols < D
    w = tl.load(w_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, N)
    for first in range(start, end, BLOCK_R):
        rows = (first + tl.arange(0, BLOCK_R)).to(tl.int64)
        r_ok = rows < end
        mask = r_ok[:, None] & c_ok[None, :]
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=r_ok, other=0.0)
        xh = x * rstd[:, None]
        dw += tl.sum(dy * xh.to(x_ptr.dtype.element_ty).to(tl.float32), 0)
        g = dy * w[None, :]
        c = tl.sum(g * xh, 1) / D
        tl.store(dx_ptr + offs, ((g - xh * c[:, None]) * rstd[:, None]).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid.to(tl.int64) * D + cols, dw, mask=c_ok)


@triton.jit
def _silu_mul_bwd(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(-tl.abs(g))
    sig = tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    s = (g * sig).to(g_ptr.dtype.element_ty).to(tl.float32)   # the rounded silu the forward multiplied by
    tl.store(du_ptr + offs, (dh * s).to(du_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + offs, (dh * u * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """t as contiguous rows of D (a copy only where it is not already)."""
    return t.reshape(-1, D).contiguous()


class RMSNorm(torch.autograd.Function):
    """weight * round(x / rms(x)) over the last dim (model.transformer.RMSNorm's math)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        D = x.shape[-1]
        if weight.shape != (D,):
            raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for rows of {D}")
        x2, w = _rows(x, D), weight.contiguous()
        N = x2.shape[0]
        # y in x's shape, no view (FSDP2 warns of a module output that is a view)
        y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        rstd = torch.empty(N, dtype=torch.float32, device=x.device)
        if N:
            block_r, block_d, warps = _tile(D)
            _rms_norm_fwd[(triton.cdiv(N, block_r),)](x2, w, y, rstd, N, D, float(eps), BLOCK_R=block_r,
                                                      BLOCK_D=block_d, num_warps=warps)
        ctx.save_for_backward(x2, w, rstd)
        ctx.shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x2, w, rstd = ctx.saved_tensors
        N, D = x2.shape
        dy2 = _rows(dy, D)
        dx = torch.empty_like(x2)
        if N == 0:
            return dx.view(ctx.shape), torch.zeros_like(w), None
        block_r, block_d, warps = _tile(D)
        programs = min(triton.cdiv(N, block_r), 4 * device_sms(x2))
        per_program = triton.cdiv(triton.cdiv(N, programs), block_r) * block_r   # whole tiles each
        programs = triton.cdiv(N, per_program)
        part = torch.empty(programs, D, dtype=torch.float32, device=x2.device)
        _rms_norm_bwd[(programs,)](x2, w, rstd, dy2, dx, part, N, D, per_program, BLOCK_R=block_r, BLOCK_D=block_d,
                                   num_warps=warps)
        return dx.view(ctx.shape), part.sum(0).to(w.dtype), None


class SwiGLU(torch.autograd.Function):
    """silu(g) * u (model.transformer.MLP's element-wise part)."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if g.shape != u.shape or g.dtype != u.dtype:
            raise ValueError(f"swiglu: gate {tuple(g.shape)} {g.dtype} and up {tuple(u.shape)} {u.dtype} must match")
        g, u = g.contiguous(), u.contiguous()
        ctx.save_for_backward(g, u)
        return silu_mul_triton(g, u)

    @staticmethod
    def backward(ctx, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, u = ctx.saved_tensors
        dh = dh.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        n = g.numel()
        if n:
            block = 1024
            _silu_mul_bwd[(triton.cdiv(n, block),)](g, u, dh, dg, du, n, BLOCK=block, num_warps=4)
        return dg, du


class Rotary(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin (model.rope.apply_rotary): x [T, H, D], cos and sin [T, D], constants."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        T, H, D = x.shape
        if cos.shape != (T, D) or sin.shape != (T, D) or D % 2:
            raise ValueError(f"rotary: x {tuple(x.shape)} with cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rope_one(x.contiguous(), cos, sin, inplace=False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rope_one(dy.contiguous(), cos, sin, inplace=False, backward=True), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNorm.apply(x, weight, eps)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return SwiGLU.apply(g, u)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return Rotary.apply(x, cos, sin)

"""RMSNorm, optionally fused with the residual add before it (the engine's GPU path; model/transformer.py keeps
its own module).

Math, identical to `model.transformer.RMSNorm`: y = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype),
so the normalised value is rounded to the activation dtype before the weight multiply, and y has dtype
promote(weight.dtype, x.dtype). With a residual: s = x + residual (rounded to x.dtype, as torch's add), y = norm(s),
and s is returned as the new residual stream.
`_rms_norm_kernel`: one program per row ([..., D] flattened to rows), the whole row in one BLOCK_D tile.
"""
from __future__ import annotations

import torch

from kernels._triton import lazy_jit, next_pow2, use_triton

tl = None  # triton.language, bound by lazy_jit at the first launch (see kernels/_triton.py)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., D]; weight [D]; residual None or like x. Returns y [..., D], or (y, x + residual) with a residual."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * h.to(dtype)
    return y if residual is None else (y, x)


@lazy_jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, D, eps, stride_x, stride_r, stride_y, stride_s,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(s_ptr.dtype.element_ty)  # rounded like torch's x + residual
        tl.store(s_ptr + row * stride_s + offs, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    h = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (w * h).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rms_norm_ref`."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, D)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
        s = torch.empty_like(x2)
    else:
        r2, s = x2, y  # unused
    if x2.shape[0] > 0:
        block_d = next_pow2(D)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, y, s, D, eps, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_D=block_d, num_warps=min(16, max(1, block_d // 256)))
    y = y.view(x.shape)
    return y if residual is None else (y, s.view(x.shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             impl: str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: the Triton kernel on CUDA, the reference on CPU; impl "triton" / "ref" forces one. Forward only
    (no autograd): for the engine, not the trainer."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if use_triton(impl, *tensors):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)

"""Triton RMSNorm, optionally fused with the residual add (contract and math: kernels.rmsnorm.rms_norm_ref).

`_rms_norm_kernel`: one program per row ([..., D] flattened to rows), the whole row in one BLOCK_D tile, in fp32;
the normalised value is rounded to x's dtype before the weight multiply, as in the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
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
        block_d = triton.next_power_of_2(D)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, y, s, D, eps, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_D=block_d, num_warps=min(16, max(1, block_d // 256)))
    y = y.view(x.shape)
    return y if residual is None else (y, s.view(x.shape))

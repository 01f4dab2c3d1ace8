"""RMSNorm, optionally fused with the residual add before it (the engine's GPU path; model/transformer.py keeps
its own module).

Math, identical to `model.transformer.RMSNorm`: y = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype),
so the normalised value is rounded to the activation dtype before the weight multiply, and y has dtype
promote(weight.dtype, x.dtype). With a residual: s = x + residual (rounded to x.dtype, as torch's add), y = norm(s),
and s is returned as the new residual stream.
This file: the reference and the dispatcher; the Triton kernel is in kernels/triton_ops/rmsnorm.py.
"""
from __future__ import annotations

import torch

from kernels.dispatch import impl_for, use_triton


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             impl: str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: the Triton kernel on CUDA, a registered implementation that takes the tensors (the C kernel for
    fp32 on the CPU, cpu/), the reference otherwise (see kernels/dispatch.py); impl "triton" / "ref" forces one.
    Forward only (no autograd): for the engine, not the trainer."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if use_triton(impl, *tensors):
        from kernels.triton_ops.rmsnorm import rms_norm_triton
        return rms_norm_triton(x, weight, eps, residual)
    fn = impl_for("rms_norm", impl, *tensors)
    if fn is not None:
        return fn(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)

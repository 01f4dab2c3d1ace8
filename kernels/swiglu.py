"""SwiGLU's elementwise part, silu(gate) * up (the engine's GPU path; model/transformer.py `MLP` keeps the eager
ops, whose rounding this matches: silu is computed in fp32 and rounded to the activation dtype, then the product
is computed in fp32 and rounded again, as torch's two ops do in bf16/fp16).
This file: the reference and the dispatcher; the Triton kernel is in kernels/triton_ops/swiglu.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dispatch import impl_for, use_triton


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] of one dtype -> silu(gate) * up, a new tensor."""
    return F.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """Dispatcher: the Triton kernel on CUDA, a registered implementation that takes the tensors (the C kernel for
    fp32 on the CPU, cpu/), the reference otherwise (see kernels/dispatch.py); impl "triton" / "ref" forces one.
    Forward only."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must match")
    if use_triton(impl, gate, up):
        from kernels.triton_ops.swiglu import silu_mul_triton
        return silu_mul_triton(gate, up)
    fn = impl_for("silu_mul", impl, gate, up)
    if fn is not None:
        return fn(gate, up)
    return silu_mul_ref(gate, up)

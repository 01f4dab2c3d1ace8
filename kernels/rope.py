"""Rotary position embedding on q and k, HF "rotate_half" layout (the engine's GPU path; the math is that of
`model.rope.apply_rotary`, which the model keeps using).

For x [T, H, D] with halves x1 = x[..., :D/2], x2 = x[..., D/2:] and cos/sin [T, D]:
  out[..., :D/2] = x1 * cos[:, :D/2] - x2 * sin[:, :D/2];  out[..., D/2:] = x2 * cos[:, D/2:] + x1 * sin[:, D/2:].
The reference computes in x's dtype op by op, exactly as the model does; the kernel computes in fp32 and rounds
once, so in bf16/fp16 the two may differ by an ulp.
This file: the reference and the dispatcher; the Triton kernel is in kernels/triton_ops/rope.py.
"""
from __future__ import annotations

import torch

from kernels.dispatch import impl_for, use_triton


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D] -> rotated (q, k), new tensors."""
    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]
    return rotate(q), rotate(k)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inplace: bool = False,
         impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: the Triton kernel on CUDA, a registered implementation that takes the tensors (the C kernel for
    fp32 on the CPU, cpu/), the reference otherwise (see kernels/dispatch.py); impl "triton" / "ref" forces one.
    Forward only. inplace=True writes the result into q and k (every path)."""
    if use_triton(impl, q, k, cos, sin):
        from kernels.triton_ops.rope import rope_triton
        return rope_triton(q, k, cos, sin, inplace)
    fn = impl_for("rope", impl, q, k, cos, sin)
    if fn is not None:
        return fn(q, k, cos, sin, inplace)
    qr, kr = rope_ref(q, k, cos, sin)
    if inplace:
        return q.copy_(qr), k.copy_(kr)
    return qr, kr

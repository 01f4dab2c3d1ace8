"""The trainer's model on CPU computes SwiGLU, RMSNorm and the rotary embedding with fused kernels
(kernels/cpu_train.py), applied from outside like the engine's packed linears (engine/cpu_linear.py): the model
stays a plain `nn.Module` with its Hugging Face parameters and state dict; `use_fused_cpu_ops(model)` swaps the
class of each `RMSNorm`, `MLP` and `Attention` module for a subclass whose forward calls the fused op when its
tensors are fp32 on the CPU and the eager one otherwise (so the same modules still run anywhere). Same values to
fp32 rounding; the long vs-TRL job's train step (256 x 268 tokens, one thread) 1.62-1.69 -> 1.30-1.39 s
(bench/RESULTS.md). The swap changes the caller's model in place: the trainer owns it from then on.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_train
from model.rope import apply_rotary
from model.transformer import MLP, Attention, RMSNorm, swap_classes


class FusedRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_train.fused(x, self.weight):
            return cpu_train.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class FusedMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(cpu_train.swiglu(g, u) if cpu_train.fused(g, u) else F.silu(g) * u)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return cpu_train.rotary(x, cos, sin) if cpu_train.fused(x, cos, sin) else apply_rotary(x, cos, sin)


class FusedAttention(Attention):
    rotate = staticmethod(_rotate)


SWAPS: dict[type, type] = {RMSNorm: FusedRMSNorm, MLP: FusedMLP, Attention: FusedAttention}


def use_fused_cpu_ops(model: nn.Module) -> int:
    """Swap the model's RMSNorm, MLP and Attention modules to their fused subclasses (before FSDP2 wraps it);
    returns how many were swapped, 0 when the kernels are unavailable (the model is left as it was)."""
    if not cpu_train.available():
        return 0
    return swap_classes(model, SWAPS)

"""The trainer's model on CPU computes its MLP (gate, up, SwiGLU, down: one C call each way; SwiGLU alone where
torch exports no sgemm), RMSNorm and the rotary embedding with fused kernels (kernels/cpu_train.py), and its causal
attention with one C kernel each way (kernels/cpu_attention.py, for the packings whose backend lists its rows:
`row_spans`), applied from outside like the engine's packed linears (engine/cpu_linear.py): the model stays a plain
`nn.Module` with its Hugging Face parameters and state dict; `use_fused_cpu_ops(model)` swaps the class of each
`RMSNorm`, `MLP` and `Attention` module for a subclass whose forward calls the fused op when its tensors are fp32 on
the CPU and the eager one otherwise (so the same modules still run anywhere). Same values to fp32 rounding; the long
vs-TRL job's train step (256 x 268 tokens, one thread) 1.62-1.69 -> 1.30-1.39 s with the element-wise kernels,
1.20-1.25 -> 0.94-0.97 s with the attention kernel, 0.98-1.04 -> 0.86-0.93 s with the MLP in blocks
(bench/RESULTS.md). The swap changes the caller's model in place: the trainer owns it from then on. The subclasses
are named Train* (with autograd); engine/fused.py's Fused* are the engine's forward-only ones.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_attention, cpu_train
from model.attention import AttentionBackend
from model.rope import apply_rotary
from model.transformer import MLP, Attention, RMSNorm, swap_classes


class TrainRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_train.fused(x, self.weight):
            return cpu_train.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class TrainMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
        if not cpu_train.fused(x, gate, up, down):
            return super().forward(x)
        if cpu_train.mlp_available() and not _has_bias(self.gate_proj, self.up_proj, self.down_proj):
            return cpu_train.mlp(x, gate, up, down)
        g, u = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(cpu_train.swiglu(g, u))


def _has_bias(*linears: nn.Linear) -> bool:
    return any(lin.bias is not None for lin in linears)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return cpu_train.rotary(x, cos, sin) if cpu_train.fused(x, cos, sin) else apply_rotary(x, cos, sin)


def _attend(attn: AttentionBackend, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The packing's rows through the C kernel when the backend can say them (`row_spans`), else its own call."""
    spans = getattr(attn, "row_spans", None)
    if spans is None or not cpu_attention.fused(q, k, v):
        return attn(layer, q, k, v)
    build = lambda: cpu_attention.CausalRows.build(spans(), q.shape[0])  # noqa: E731
    memo = getattr(attn, "derived", None)   # a backend without the memo plans again each layer
    plan = memo("cpu_rows", build) if memo is not None else build()
    return cpu_attention.causal_rows_attention(q, k, v, plan, getattr(attn, "scale", None))


class TrainAttention(Attention):
    rotate = staticmethod(_rotate)
    attend = staticmethod(_attend)


SWAPS: dict[type, type] = {RMSNorm: TrainRMSNorm, MLP: TrainMLP, Attention: TrainAttention}


def use_fused_cpu_ops(model: nn.Module) -> int:
    """Swap the model's RMSNorm, MLP and Attention modules to their fused subclasses (before FSDP2 wraps it);
    returns how many were swapped, 0 when the kernels are unavailable (the model is left as it was)."""
    if not cpu_train.available():
        return 0
    return swap_classes(model, SWAPS)

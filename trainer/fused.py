"""The trainer's model computes RMSNorm, SwiGLU and the rotary embedding with fused kernels, with autograd: Triton
on CUDA (kernels/triton_ops/train.py), C on the CPU in fp32 (kernels/cpu_train.py, where the whole MLP is one C
call each way: gate, up, SwiGLU, down; SwiGLU alone where torch exports no sgemm), and on the CPU its causal
attention too (kernels/cpu_attention.py, one C kernel each way, for the packings whose backend lists its rows:
`row_spans`). Applied from outside like the engine's kernels (engine/fused.py): the model stays a plain
`nn.Module` with its Hugging Face parameters and state dict; `use_fused_train_ops(model, device)` swaps the class of
each `RMSNorm`, `MLP` and `Attention` module for a subclass whose forward picks, per call, the kernel its tensors
can take (`ops_for`: Triton where the dispatcher of kernels/dispatch.py says so, the C kernels for fp32 CPU
tensors) and the eager ops otherwise, so the same modules still run anywhere. `perf.fused_kernels = false` keeps
the eager modules (the comparison bench/train.py makes on a GPU).

Measured on the CPU (bench/RESULTS.md): the long vs-TRL job's train step (256 x 268 tokens, one thread)
1.62-1.69 -> 1.30-1.39 s with the element-wise kernels, 1.20-1.25 -> 0.94-0.97 s with the attention kernel,
0.98-1.04 -> 0.86-0.93 s with the MLP in blocks. On an H200 (`bench/train.py --eager off`, the Qwen3-1.7B shape,
8192-token micro-batches, alternating in one process): 2.40-2.44 -> 2.08-2.16 s a step, MFU 0.32 -> 0.36-0.37.
The swap changes the caller's model in place: the trainer owns it from then on. The subclasses are named Train*
(with autograd); engine/fused.py's Fused* are the engine's forward-only ones.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels import cpu_attention, cpu_train
from kernels.dispatch import HAS_TRITON, resolve_impl, use_triton
from model.attention import AttentionBackend
from model.rope import apply_rotary
from model.transformer import MLP, Attention, RMSNorm, swap_classes


def ops_for(*tensors: torch.Tensor) -> Any:
    """The module of autograd ops these tensors take (`rms_norm`, `swiglu`, `rotary`): kernels/triton_ops/train.py
    where the dispatcher picks Triton (CUDA tensors, or TIDAL_KERNELS=triton under TRITON_INTERPRET=1: the tests'
    path), kernels/cpu_train.py for fp32 CPU tensors with the C kernels built, None for the eager ops."""
    if use_triton(None, *tensors):
        from kernels.triton_ops import train
        return train
    return cpu_train if cpu_train.fused(*tensors) else None


class TrainRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = ops_for(x, self.weight)
        return super().forward(x) if ops is None else ops.rms_norm(x, self.weight, self.eps)


class TrainMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight
        ops = ops_for(x, gate, up, down)
        if ops is None:
            return super().forward(x)
        if ops is cpu_train and cpu_train.mlp_available() and not _has_bias(self.gate_proj, self.up_proj,
                                                                            self.down_proj):
            return cpu_train.mlp(x, gate, up, down)
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))


def _has_bias(*linears: nn.Linear) -> bool:
    return any(lin.bias is not None for lin in linears)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    ops = ops_for(x, cos, sin)
    return apply_rotary(x, cos, sin) if ops is None else ops.rotary(x, cos, sin)


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


def available(device: torch.device | str) -> bool:
    """Whether a model on `device` would run any fused kernel: Triton for CUDA (or forced), the C kernels on CPU."""
    if torch.device(device).type == "cuda" or resolve_impl(None) == "triton":
        return HAS_TRITON
    return torch.device(device).type == "cpu" and cpu_train.available()


def use_fused_train_ops(model: nn.Module, device: torch.device | str) -> int:
    """Swap the model's RMSNorm, MLP and Attention modules to their fused subclasses (before FSDP2 wraps it), for a
    model that will run on `device`; returns how many were swapped, 0 when no kernel is available there (the model
    is left as it was)."""
    if not available(device):
        return 0
    return swap_classes(model, SWAPS)

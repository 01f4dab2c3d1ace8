"""The trainer's model computes RMSNorm, SwiGLU and the rotary embedding with fused kernels, with autograd: Triton
on CUDA (kernels/triton_ops/train.py), or the ops a backend registered (`register_train_ops`: the optional cpu/
package registers its C kernels for fp32 CPU tensors, where the whole MLP is one C call each way, and its causal
attention for the packings whose backend lists its rows, `row_spans`). Applied from outside like the engine's
kernels (engine/fused.py): the model stays a plain `nn.Module` with its Hugging Face parameters and state dict;
`use_fused_train_ops(model, device)` swaps the class of each `RMSNorm`, `MLP` and `Attention` module for a subclass
whose forward picks, per call, the kernels its tensors can take (`ops_for`: Triton where the dispatcher of
kernels/dispatch.py says so, else a registered backend's) and the eager ops otherwise, so the same modules still run
anywhere. `perf.fused_kernels = false` keeps the eager modules (the comparison bench/train.py makes on a GPU).

Measured (bench/results/cpu-vs-trl.md, bench/results/gpu-h200.md): on the CPU the long vs-TRL job's train step (256 x
268 tokens, one thread) 1.62-1.69 -> 1.30-1.39 s with the element-wise kernels, 1.20-1.25 -> 0.94-0.97 s with the
attention kernel, 0.98-1.04 -> 0.86-0.93 s with the MLP in blocks. On an H200 (`bench/train.py --eager off`, the
Qwen3-1.7B shape, 8192-token micro-batches, alternating in one process): 2.40-2.44 -> 2.08-2.16 s a step, MFU 0.32 ->
0.36-0.37. The swap changes the caller's model in place: the trainer owns it from then on. The subclasses are named
Train* (with autograd); engine/fused.py's Fused* are the engine's forward-only ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from kernels.dispatch import HAS_TRITON, resolve_impl, use_triton
from model.attention import AttentionBackend
from model.rope import apply_rotary
from model.transformer import MLP, Attention, RMSNorm, swap_classes


@dataclass(frozen=True)
class TrainBackend:
    """Fused train ops a backend registered (`register_train_ops`; the optional cpu/ package registers its C kernels).
    `serves(device)`: whether a model on that device would run any of them. `ops_for(*tensors)`: the namespace of
    autograd ops these tensors take, or None; it has `rms_norm`, `swiglu` and `rotary` as kernels/triton_ops/train.py
    does, and may have `mlp(x, gate, up, down)` (the whole MLP as one op) with `mlp_available()`. `attend(attn,
    layer, q, k, v)`: the attention of a packing as the backend computes it, or None for the packing's own call."""
    serves: Callable[[torch.device], bool]
    ops_for: Callable[..., Any]
    attend: Callable[..., torch.Tensor | None] | None = None


BACKENDS: list[TrainBackend] = []


def register_train_ops(backend: TrainBackend) -> None:
    """Register a backend's fused train ops (after Triton, which CUDA tensors take first)."""
    if backend not in BACKENDS:
        BACKENDS.append(backend)


def ops_for(*tensors: torch.Tensor) -> Any:
    """The module of autograd ops these tensors take (`rms_norm`, `swiglu`, `rotary`): kernels/triton_ops/train.py
    where the dispatcher picks Triton (CUDA tensors, or TIDAL_KERNELS=triton under TRITON_INTERPRET=1: the tests'
    path), else the first registered backend's that takes them, None for the eager ops."""
    if use_triton(None, *tensors):
        from kernels.triton_ops import train
        return train
    for backend in BACKENDS:
        ops = backend.ops_for(*tensors)
        if ops is not None:
            return ops
    return None


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
        if (getattr(ops, "mlp", None) is not None and ops.mlp_available()
                and not _has_bias(self.gate_proj, self.up_proj, self.down_proj)):
            return ops.mlp(x, gate, up, down)
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))


def _has_bias(*linears: nn.Linear) -> bool:
    return any(lin.bias is not None for lin in linears)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    ops = ops_for(x, cos, sin)
    return apply_rotary(x, cos, sin) if ops is None else ops.rotary(x, cos, sin)


def _attend(attn: AttentionBackend, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The packing's attention as a registered backend computes it, else its own call."""
    for backend in BACKENDS:
        out = backend.attend(attn, layer, q, k, v) if backend.attend is not None else None
        if out is not None:
            return out
    return attn(layer, q, k, v)


class TrainAttention(Attention):
    rotate = staticmethod(_rotate)
    attend = staticmethod(_attend)


SWAPS: dict[type, type] = {RMSNorm: TrainRMSNorm, MLP: TrainMLP, Attention: TrainAttention}


def available(device: torch.device | str) -> bool:
    """Whether a model on `device` would run any fused kernel: Triton for CUDA (or forced), else a registered
    backend's."""
    if torch.device(device).type == "cuda" or resolve_impl(None) == "triton":
        return HAS_TRITON
    return any(backend.serves(torch.device(device)) for backend in BACKENDS)


def use_fused_train_ops(model: nn.Module, device: torch.device | str) -> int:
    """Swap the model's RMSNorm, MLP and Attention modules to their fused subclasses (before FSDP2 wraps it), for a
    model that will run on `device`; returns how many were swapped, 0 when no kernel is available there (the model
    is left as it was)."""
    if not available(device):
        return 0
    return swap_classes(model, SWAPS)

"""The trainer's CPU kernels, registered into trainer/fused.py by `cpu.enable`: the autograd ops of cpu/ops.py
(RMSNorm, SwiGLU, rotary embedding, and the whole MLP in one C call each way) for fp32 CPU tensors, and the causal
attention of cpu/train_attention.py for the packings whose backend lists its rows (model/attention.py `row_spans`).
"""
from __future__ import annotations

from types import ModuleType

import torch

from cpu import ops, train_attention
from model.attention import AttentionBackend
from trainer.fused import TrainBackend


def ops_for(*tensors: torch.Tensor) -> ModuleType | None:
    """cpu/ops.py for fp32 CPU tensors with the C kernels built, else None."""
    return ops if ops.fused(*tensors) else None


def serves(device: torch.device) -> bool:
    return device.type == "cpu" and ops.available()


def attend(attn: AttentionBackend, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
           ) -> torch.Tensor | None:
    """The packing's rows through the C kernel when the backend can say them (`row_spans`), else None (the
    backend's own call)."""
    spans = getattr(attn, "row_spans", None)
    if spans is None or not train_attention.fused(q, k, v):
        return None
    build = lambda: train_attention.CausalRows.build(spans(), q.shape[0])  # noqa: E731
    memo = getattr(attn, "derived", None)   # a backend without the memo plans again each layer
    plan = memo("cpu_rows", build) if memo is not None else build()
    return train_attention.causal_rows_attention(q, k, v, plan, getattr(attn, "scale", None))


BACKEND = TrainBackend(serves=serves, ops_for=ops_for, attend=attend)

"""The engine's model runs RMSNorm (fused with the residual add before it), the rotary embedding and SwiGLU's
elementwise part as one kernel each, through the dispatchers of kernels/ (rmsnorm.py, rope.py, swiglu.py): the
Triton kernels on CUDA (or TIDAL_KERNELS=triton under TRITON_INTERPRET=1, the tests' path), or a family of kernels a
backend registered (`register_ops`: the optional cpu/ package's C kernels for fp32 on the CPU). Applied from
outside like the trainer's kernels
(trainer/fused.py): the model stays a plain `nn.Module` with its Hugging Face parameters and state dict, so
weight loads and publications are unchanged; `use_fused_ops(model)` swaps the class of the `Transformer`, of each
`Attention` and of each `MLP` for a subclass whose forward calls the kernels when a dispatcher picks one for its
tensors and no gradient is being recorded (the kernels are forward-only), and the eager forward otherwise.

Why: the eager ops launch one kernel per elementwise step. A decode step of Qwen3-0.6B at batch 255
(bench/results/gpu-h200.md) ran ~700 small kernels beside its 28 attention calls: RMSNorm alone is seven (pow, mean,
add, rsqrt, mul, cast, mul) for each of the four norms of a layer, the residual add one more, the rotary embedding five
per tensor. Fused: one kernel per norm (the residual add inside it), one per rotated tensor, one for silu * up.

On the CPU (one thread, fp32) the eager ops cost a few microseconds each of dispatch and allocation over a
[256, 64] batch: RMSNorm's seven ops took ~45 us a call, nine calls a decode step of the tiny model; the long
vs-TRL job's engine round (256 sequences x 256 tokens) 1.11-1.12 -> 1.00-1.02 s with the C kernels, 0.94-0.95 s
with the kernels chosen once per module call (`kernels_for`) instead of per op.

Same math as the eager model: the residual stream is carried into the next norm (x + attn(...) is the fused norm's
`residual` output, so the sum is rounded exactly as torch's add), each norm rounds the normalised value to the
activation dtype before the weight multiply, silu is rounded before the product. Only the order of the fp32 sums
inside a norm differs, so outputs agree to rounding (tests/engine/test_engine_fused.py). Measured (H200, with the
sampling kernel of kernels/sample.py): the 256-sequence engine benchmark 16.4 -> 9.4 s, a decode step at batch
255 12.6 -> 8.7 ms, 0.36 -> 0.52 of the memory roofline.

The swap changes the engine's model in place (`EngineConfig.fused_ops`; with it off the runner swaps a model
back to the eager classes): the engine owns its model, and the trainer's model is another copy (runtime/).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from kernels.dispatch import use_triton
from kernels.rmsnorm import rms_norm
from kernels.rope import rope
from kernels.swiglu import silu_mul
from model.attention import AttentionBackend
from model.transformer import MLP, Attention, Transformer, swap_classes


@dataclass(frozen=True)
class Ops:
    """One family of kernels: the same three forward-only ops and signatures as kernels/rmsnorm.py, rope.py and
    swiglu.py (decided once per module call, so the per-op dispatch is not paid again per op)."""
    rms_norm: Callable[..., Any]
    rope: Callable[..., Any]
    silu_mul: Callable[..., Any]


TRITON = Ops(partial(rms_norm, impl="triton"), partial(rope, impl="triton"), partial(silu_mul, impl="triton"))
# Kernel families a backend registered (`register_ops`): each a function of the tensors giving its Ops, or None
# where it does not take them (the optional cpu/ package: its C kernels for fp32 CPU tensors).
FAMILIES: list[Callable[..., Ops | None]] = []


def register_ops(pick: Callable[..., Ops | None]) -> None:
    """Register a backend's kernel family: `pick(*tensors)` gives its Ops for these tensors, or None."""
    if pick not in FAMILIES:
        FAMILIES.append(pick)


def kernels_for(*tensors: torch.Tensor) -> Ops | None:
    """The kernels that run on these tensors, None for the eager ops: none while a graph is recorded (the kernels
    are forward-only), else Triton as the dispatchers would pick it (kernels/dispatch.py), else the first registered
    family that takes them."""
    if torch.is_grad_enabled():
        return None
    if use_triton(None, *tensors):
        return TRITON
    for pick in FAMILIES:
        ops = pick(*tensors)
        if ops is not None:
            return ops
    return None


def fused(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels run on these tensors."""
    return kernels_for(*tensors) is not None


def has_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on this device and dtype would run the kernels (what `ModelRunner` swaps for)."""
    probe = torch.empty(0, device=device, dtype=dtype)
    with torch.no_grad():
        return fused(probe)


class FusedAttention(Attention):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        ops = kernels_for(x, cos)
        return super().forward(x, cos, sin, attn) if ops is None else self.fused(ops, x, cos, sin, attn)

    def fused(self, ops: Ops, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
              ) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        q, k = ops.rope(q, k, cos, sin, inplace=True)  # fresh tensors (the norms' or the projections' outputs)
        out = attn(self.layer, q, k, v)
        return self.o_proj(out.reshape(T, self.n_heads * self.head_dim))


class FusedMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = kernels_for(x)
        return super().forward(x) if ops is None else self.fused(ops, x)

    def fused(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class FusedTransformer(Transformer):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """As Transformer.forward; with the kernels, each block's two residual adds happen inside the next norm. The
        kernel family is chosen once here (every tensor of the forward has the weights' device and dtype) and the
        blocks' fused methods are called directly (on the CPU each `kernels_for` is ~4 us and each `nn.Module` call
        ~2 us: ~25 us of a ~3.7 ms decode step of the tiny model)."""
        ops = kernels_for(self.model.embed_tokens.weight)   # (the ids are integers: the weights say device, dtype)
        if ops is None:
            return super().forward(input_ids, positions, attn)
        norm_ = ops.rms_norm
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        residual = None
        for block in self.model.layers:
            n1, n2 = block.input_layernorm, block.post_attention_layernorm
            if residual is None:
                h, residual = norm_(x, n1.weight, n1.eps), x
            else:
                h, residual = norm_(x, n1.weight, n1.eps, residual)
            h, residual = norm_(block.self_attn.fused(ops, h, cos, sin, attn), n2.weight, n2.eps, residual)
            x = block.mlp.fused(ops, h)
        norm = self.model.norm
        return norm_(x, norm.weight, norm.eps) if residual is None else norm_(x, norm.weight, norm.eps, residual)[0]


SWAPS: dict[type, type] = {Transformer: FusedTransformer, Attention: FusedAttention, MLP: FusedMLP}


def use_eager_ops(model: nn.Module) -> int:
    """Undo `use_fused_ops`: the swapped modules get their eager classes back; returns how many."""
    return swap_classes(model, {v: k for k, v in SWAPS.items()})


def use_fused_ops(model: nn.Module) -> int:
    """Swap the model's Transformer, Attention and MLP modules to their fused subclasses, in place; returns how
    many were swapped (a module already swapped, or of another class, is left alone)."""
    return swap_classes(model, SWAPS)

"""Per-block `torch.compile` of the trainer's model (torchtitan's per-block compile), applied from outside like FSDP2
and activation checkpointing: `compile_blocks(model)` replaces each decoder block's `forward` with a compiled one,
before checkpointing wraps it and FSDP2's hooks go around the block's call (trainer/fsdp.py), so neither is traced.

Why: the colocated GRPO step's training phase on an H200 was host-bound (bench/results/gpu-h200.md: the device
busy 4.1 s of its 10.8 s under the profiler, ~4,800 kernel launches a micro-batch); inductor fuses each block's
norms, rotary embedding, SwiGLU and residual adds into few kernels and runs them without Python between the ops.

What stays eager: the attention call (`Attention.attend`, through the packing's backend: a flash varlen kernel on
CUDA), behind `torch.compiler.disable`, a graph break, because the backends are Python objects whose per-packing
lengths would be guarded on (a recompile per micro-batch). Each block then runs two graphs: up to q, k, v (norm,
projections, q/k norms, rotary), and from the attention's output on (o_proj, residual, norm, MLP, residual).

Invariants: one compiled code for every block and every micro-batch: shapes are dynamic from the first call
(`dynamic=True`: micro-batches differ in tokens), and a block's layer index (read to pass to the attention, an int
attribute) is not specialised on (`torch._dynamo.config.allow_unspec_int_on_nn_module`), else each block would
compile its own graphs and past the recompile limit (8) the rest would run eager. The parameters are the module's
(graph inputs, not constants: `inline_inbuilt_nn_modules`), so FSDP2's gathered tensors and the optimizer's updates
are read at each call. Numerics: inductor's fused fp32 math rounds differently from the eager ops (tests/trainer/
test_compile.py bounds it).
"""
from __future__ import annotations

import torch
from torch import nn


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile each block of `model` (a model.Transformer, before sharding and checkpointing) in place; returns how
    many. Idempotent: a block already compiled is left as it is."""
    from torch._dynamo import config as dynamo_config
    from torch._inductor import config as inductor_config
    dynamo_config.allow_unspec_int_on_nn_module = True
    # runtime/build.py deterministic_algorithms sets inductor's flag only where inductor was imported: here, now
    inductor_config.deterministic = torch.are_deterministic_algorithms_enabled()
    eager_attend: dict[type, object] = {}   # one disabled function per attention class: the same for every block
    n = 0
    for block in model.model.layers:
        if getattr(block, "_tidal_compiled", False):
            continue
        attn = block.self_attn
        cls = type(attn)
        if cls not in eager_attend:
            eager_attend[cls] = torch.compiler.disable(cls.attend)
        attn.attend = eager_attend[cls]   # an instance attribute: a plain function, called as the staticmethod is
        block.forward = torch.compile(block.forward, backend=backend, dynamic=True)
        block._tidal_compiled = True
        n += 1
    return n

"""Engine settings: KV pool size, batching limits, device and dtype."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import DTYPES


@dataclass
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    # KV pool size: num_kv_tokens, else kv_cache_bytes, else (CUDA) memory_fraction of the GPU memory still free
    # after the weights and a warm-up forward, else (CPU) room for max_num_seqs full-length sequences, at most 1 GiB.
    num_kv_tokens: int | None = None
    kv_cache_bytes: int | None = None
    memory_fraction: float = 0.9
    max_num_seqs: int = 256  # sequences running at once (each holds KV blocks)
    max_batch_tokens: int = 4096  # tokens computed per step (decodes + prefill chunks)
    max_model_len: int | None = None  # prompt + generated; default: the model's max_position_embeddings
    chunked_prefill: bool = True  # a prompt longer than the step's leftover budget is prefilled over several steps
    dtype: str | torch.dtype | None = None  # weights and KV; default: the model's parameter dtype
    device: str | torch.device | None = None  # default: where the model's parameters are
    cuda_graphs: bool = True  # capture decode steps per batch-size bucket (CUDA only)
    # "auto" | "kernels" (the kernels/ dispatchers) | "batched" (the CPU batched path) | "native" (the cpu/ package:
    # batched, rows through its C paged attention; there "auto" picks it on CPU for fp32 when it builds)
    attention: str = "auto"
    # RMSNorm (+ the residual add), rotary embedding and SwiGLU as one kernel each (engine/fused.py): Triton where
    # the kernel dispatcher picks it (CUDA, or anywhere with TIDAL_KERNELS=triton), a registered family elsewhere
    # (cpu/'s C kernels for fp32 on the CPU)
    fused_ops: bool = True
    # The CPU engine of the optional cpu/ package (cpu/engine.py), fp32: Linear layers through oneDNN on pre-packed
    # weights, those with at least cpu_packed_min_weight elements (smaller ones: MKL on rows padded to a multiple of
    # 8, faster there and nothing to repack per load; batch-invariant either way); for small models the whole
    # forward of a step in one C call (cpu_forward), same bits as op by op; and up to cpu_decode_steps decode steps
    # in one C call per `step()` (1: one step a call, as every other engine); the same tokens and logprobs either way
    cpu_packed_linear: bool = True
    cpu_packed_min_weight: int = 1 << 20
    cpu_forward: bool = True
    cpu_decode_steps: int = 1
    # plain temperature sampling as one Triton kernel where the dispatcher picks Triton (kernels/sample.py)
    fused_sampling: bool = True
    seed: int = 0  # the engine's generator, used by requests without their own seed

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_batch_tokens < self.max_num_seqs:
            raise ValueError(f"need 1 <= max_num_seqs ({self.max_num_seqs}) <= max_batch_tokens "
                             f"({self.max_batch_tokens}): every running sequence takes a token per step")
        if self.cpu_decode_steps < 1:
            raise ValueError(f"cpu_decode_steps must be >= 1, got {self.cpu_decode_steps}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
            self.dtype = DTYPES[self.dtype]

"""FSDP2 for our Transformer, applied from the outside (torchtitan style), plus full-tensor gathering.

- The mesh is an explicit 1-D DeviceMesh built from the train group (`DeviceMesh.from_group`), so the train
  partition shards among itself only, on CPU (gloo) as on GPU (NCCL). A 2-D mesh would mean hybrid sharding.
- One FSDP unit per decoder block, then the root (embedding, final norm and lm_head: with tied embeddings the one
  shared weight lives in the root unit). Mixed precision: bf16 params / fp32 gradient reduction on GPU, fp32 on CPU.
- Activation checkpointing wraps each block's forward (non-reentrant `torch.utils.checkpoint`) before sharding,
  keeping the parameter names exactly the HF ones (no `_checkpoint_wrapped_module.` prefix).
- `full_tensors` gathers each parameter with `DTensor.full_tensor()` inside the train group, because
  `get_model_state_dict` with `StateDictOptions(full_state_dict=True, cpu_offload=True)` gives the values to global
  rank 0 only (every other rank gets an empty dict; PyTorch's `StateDictOptions`), which may be a rollout rank.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint


def build_mesh(group: dist.ProcessGroup | None = None, device_type: str = "cpu") -> DeviceMesh:
    """A 1-D mesh over the ranks of `group` (default: the whole world)."""
    return DeviceMesh.from_group(group or dist.group.WORLD, device_type)


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of storing them (call before sharding)."""
    for block in model.model.layers:
        if not isinstance(block.forward, functools.partial):
            block.forward = functools.partial(_checkpointed, block.forward)


def mixed_precision(device_type: str) -> MixedPrecisionPolicy:
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def shard_model(model: nn.Module, mesh: DeviceMesh, activation_checkpointing: bool = False,
                mp_policy: MixedPrecisionPolicy | None = None, reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` (a model.Transformer with full weights on every rank of `mesh`) in place; returns it.
    reshard_after_forward applies to the blocks; the root always keeps its parameters gathered until backward."""
    if is_sharded(model):
        return model
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    mp_policy = mp_policy or mixed_precision(mesh.device_type)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    # The root stays unsharded after forward: the trainer applies lm_head to the hidden states outside forward
    # (chunked logprobs), so the weight must still be the gathered tensor then; backward reshards it.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    return model


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def unique_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, param) in module order, a tied weight once under its first name (model.embed_tokens.weight)."""
    return list(model.named_parameters(remove_duplicate=True))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an all-gather inside the DTensor's own mesh (collective over the train group)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every unique parameter. Every train rank must iterate it in step."""
    for name, p in unique_parameters(model):
        yield name, full_tensor(p.detach())


def full_state_dict(model: nn.Module, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """All unique parameters gathered on every train rank (collective), copied to `device`."""
    return {name: t.to(device, copy=True) for name, t in full_tensors(model)}

"""FSDP2 for our Transformer, applied from the outside (torchtitan style), plus full-tensor gathering.

- The mesh is an explicit 1-D DeviceMesh built from the train group (`DeviceMesh.from_group`), so the train
  partition shards among itself only, on CPU (gloo) as on GPU (NCCL). A 2-D mesh would mean hybrid sharding.
- One FSDP unit per decoder block, then the root (embedding, final norm and lm_head: with tied embeddings the one
  shared weight lives in the root unit). Mixed precision: bf16 params / fp32 gradient reduction on GPU, fp32 on CPU.
- Activation checkpointing wraps each block's forward (non-reentrant `torch.utils.checkpoint`) before sharding,
  keeping the parameter names exactly the HF ones (no `_checkpoint_wrapped_module.` prefix).
- `gather_full` gathers many parameters with one all-gather (not one `DTensor.full_tensor()` each: on gloo every
  collective is a fixed cost of about a millisecond, which dominated publishing a small model), inside the train
  group, because
  `get_model_state_dict` with `StateDictOptions(full_state_dict=True, cpu_offload=True)` gives the values to global
  rank 0 only (every other rank gets an empty dict; PyTorch's `StateDictOptions`), which may be a rollout rank.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
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
                mp_policy: MixedPrecisionPolicy | None = None, reshard_after_forward: bool = True,
                unit: str = "block") -> nn.Module:
    """Shard `model` (a model.Transformer with full weights on every rank of `mesh`) in place; returns it.
    unit "block": every block is an FSDP2 unit of its own (reshard_after_forward applies to them), gathered in turn;
    "model": the root is the only unit (the whole model gathered at once: one all-gather and one reduce-scatter per
    micro-batch). The root always keeps its parameters gathered until backward."""
    if unit not in ("block", "model"):
        raise ValueError(f"unknown FSDP unit {unit!r}: 'block' or 'model'")
    if is_sharded(model):
        return model
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    mp_policy = mp_policy or mixed_precision(mesh.device_type)
    for block in model.model.layers if unit == "block" else ():
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
def gather_full(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole tensors, with one all-gather for all the DTensors among them when they share FSDP2's layout (a
    1-D mesh, Shard(0), one dtype: rank r holds rows [r*c, min((r+1)*c, n)) of n, c = ceil(n / world), as
    `torch.chunk` splits them); one `full_tensor()` each otherwise. Collective over the mesh: every rank of it
    calls this with the same list. Plain tensors come back as they are."""
    dts = [t for t in tensors if isinstance(t, DTensor)]
    if not dts:
        return list(tensors)
    mesh = dts[0].device_mesh
    if mesh.ndim != 1 or any(t.device_mesh != mesh or tuple(t.placements) != (Shard(0),) or t.dtype != dts[0].dtype
                             for t in dts):
        return [full_tensor(t) for t in tensors]
    world = mesh.size()
    if world == 1:
        return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    chunks = [-(-t.shape[0] // world) for t in dts]
    segs = [c * math.prod(t.shape[1:]) for c, t in zip(chunks, dts)]
    local = dts[0].to_local()
    send = torch.zeros(sum(segs), dtype=local.dtype, device=local.device)
    off = 0
    for t, n in zip(dts, segs):
        flat = t.to_local().reshape(-1)
        send[off:off + flat.numel()].copy_(flat)
        off += n
    out = torch.empty(world, send.numel(), dtype=send.dtype, device=send.device)
    _all_gather_single(out.view(-1), send, group=mesh.get_group())
    full, off = {}, 0
    for t, c, n in zip(dts, chunks, segs):
        rows = t.shape[0]
        parts = [out[r, off:off + n].view(c, *t.shape[1:])[:max(0, min(c, rows - r * c))] for r in range(world)]
        full[id(t)] = torch.cat(parts)
        off += n
    return [full[id(t)] if isinstance(t, DTensor) else t for t in tensors]


def _all_gather_single(out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Every rank's `send` laid end to end in `out`: `all_gather_single` where torch has it, else the same collective
    under its older name, `all_gather_into_tensor` (which newer torch deprecates, warning on every call)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, send, group=group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()   # a DTensor's global size


@torch.no_grad()
def full_tensors(model: nn.Module, bucket_bytes: int = 256 << 20) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every unique parameter, one all-gather per `bucket_bytes` of full
    tensors (peak memory: one bucket). Every train rank must iterate it in step."""
    params = unique_parameters(model)
    start = 0
    while start < len(params):
        end, size = start, 0
        while end < len(params) and (end == start or size + _nbytes(params[end][1]) <= bucket_bytes):
            size += _nbytes(params[end][1])
            end += 1
        names = [n for n, _ in params[start:end]]
        yield from zip(names, gather_full([p.detach() for _, p in params[start:end]]))
        start = end


def full_state_dict(model: nn.Module, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """All unique parameters gathered on every train rank (collective), copied to `device`."""
    return {name: t.to(device, copy=True) for name, t in full_tensors(model)}

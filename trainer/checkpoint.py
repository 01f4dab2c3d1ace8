"""Resumable checkpoints with torch.distributed.checkpoint (DCP), and export to the Hugging Face layout.

`save` writes `dir/step_{k}`: the model's and the optimizer's (sharded) state through DCP (each train rank writes
its own shards; a later load may use a different number of ranks), plus one small `extra_rank{r}.pt` per rank
holding the LR scheduler and an arbitrary `extra` dict (data position, RNG, controller / policy state, versions:
the runtime fills it). Everything goes to `dir/.tmp_step_{k}` first; only when every rank has finished does the
leader write a COMPLETE marker and rename the directory into place, so a crash mid-write never damages the last
good checkpoint, and `latest(dir)` only ever returns complete ones. All train ranks call `save` / `load`
together; the directory must be visible to all of them (a shared filesystem across nodes).

`export_hf` gathers each parameter whole inside the train group and the leader writes config.json + safetensors
with `model.hf_io.save_model`, so the result opens in transformers or vLLM.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, \
    set_state_dict

from model.config import ModelConfig
from model.hf_io import save_model
from trainer.fsdp import full_state_dict

STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"


def _dist(group: dist.ProcessGroup | None) -> tuple[bool, int]:
    on = dist.is_available() and dist.is_initialized()
    return on, (dist.get_rank(group) if on else 0)


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def completed(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ckpt_dir, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / COMPLETE).is_file()]
    return sorted(found)


def latest(ckpt_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    done = completed(ckpt_dir)
    return done[-1][1] if done else None


def save(ckpt_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         scheduler: Any = None, extra: dict[str, Any] | None = None, group: dist.ProcessGroup | None = None,
         keep_last: int | None = None) -> Path:
    """Write dir/step_{step} atomically (see the module docstring); keep only the newest `keep_last` if given."""
    on, rank = _dist(group)
    root = Path(ckpt_dir)
    final, tmp = root / f"step_{step}", root / f".tmp_step_{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # the leftovers of an earlier crash
        tmp.mkdir(parents=True)
    _barrier(group)
    state = _state(model, optimizer)
    dcp.save(state, checkpoint_id=str(tmp), process_group=group, no_dist=not on)
    torch.save({"scheduler": scheduler.state_dict() if scheduler is not None else None, "extra": extra},
               tmp / f"extra_rank{rank}.pt")
    _barrier(group)
    if rank == 0:
        (tmp / COMPLETE).write_text(f"step {step}\n")
        if final.exists():  # saving the same step again replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep_last:
            for _, old in completed(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier(group)
    return final


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What DCP saves and loads: the model's (sharded) state dict, and the optimizer's when there is one."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
         group: dist.ProcessGroup | None = None) -> dict[str, Any] | None:
    """Restore model (+ optimizer, scheduler) in place from a checkpoint directory; returns this rank's `extra`."""
    on, rank = _dist(group)
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {COMPLETE} marker)")
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path), process_group=group, no_dist=not on)
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
    own = path / f"extra_rank{rank}.pt"
    # weights_only: tensors and plain containers only, never arbitrary pickled objects (a checkpoint directory is
    # data, not code), so `extra` and the policies' state_dicts must hold only those.
    side = torch.load(own if own.is_file() else path / "extra_rank0.pt", weights_only=True)
    if scheduler is not None and side["scheduler"] is not None:
        scheduler.load_state_dict(side["scheduler"])
    return side["extra"]


def read_extra(path: str | Path, rank: int = 0) -> dict[str, Any]:
    """One rank's side file of a complete checkpoint ({"scheduler": ..., "extra": ...}) without loading any
    weights: what a restarting leader reads before it opens its logs."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {COMPLETE} marker)")
    side = torch.load(path / f"extra_rank{rank}.pt", weights_only=True)
    return side["extra"] or {}


def export_hf(model: nn.Module, cfg: ModelConfig, path: str | Path, group: dist.ProcessGroup | None = None,
              dtype: torch.dtype | None = None) -> None:
    """Write the HF layout (config.json + safetensors) of the current weights. All train ranks call it."""
    _, rank = _dist(group)
    state = full_state_dict(model)  # collective: every rank gathers, the leader writes
    if rank == 0:
        save_model(state, cfg, path, dtype=dtype)
    _barrier(group)

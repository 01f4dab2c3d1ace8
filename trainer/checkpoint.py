"""Resumable checkpoints with torch.distributed.checkpoint (DCP), and export to the Hugging Face layout.

`save` writes `dir/step_{k}`: the model's and the optimizer's (sharded) state through DCP (each train rank writes
its own shards; a later load may use a different number of ranks), plus one small `extra_rank{r}.pt` per rank
holding the LR scheduler and an arbitrary `extra` dict (data position, RNG, controller / policy state, versions:
the runtime fills it). Everything goes to `dir/.tmp_step_{k}` first; only when every rank has finished does the
leader write the COMPLETE marker, the manifest of every file with its size, and rename the directory into place,
so a crash mid-write never damages the last good checkpoint. A write that fails on any rank (disk full, no
permission, an unpicklable `extra`) fails on every rank alike, with a CheckpointError naming the path and the
rank's error; the temporary directory is removed and the previous checkpoint is untouched. `latest(dir)` returns
the newest checkpoint that can be resumed from: marked COMPLETE, with every file of its manifest there at its
written size (`problem` says why one cannot; `scan` lists them all, interrupted writes included). The files' bytes
are not read: a file of the right size with damaged content fails at load. All train ranks call `save` / `load`
together; the directory must be visible to all of them (a shared filesystem across nodes).

`export_hf` gathers each parameter whole inside the train group and the leader writes config.json + safetensors
with `model.hf_io.save_model`, so the result opens in transformers or vLLM.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from model.config import ModelConfig

# torch.distributed.checkpoint (and FSDP2's DTensor under it) is imported by the functions that save or load: the
# file-level ones (problem, scan, latest, read_extra) serve every rank's start-up, rollout ranks included.

STEP_DIR = re.compile(r"^(\.tmp_|\.old_)?step_(\d+)$")   # .old_: a complete one being replaced by a new save
COMPLETE = "COMPLETE"
Progress = Callable[[str], None]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or cannot be resumed from; the message names the path."""


def _dist(group: dist.ProcessGroup | None) -> tuple[bool, int]:
    on = dist.is_available() and dist.is_initialized()
    return on, (dist.get_rank(group) if on else 0)


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def problem(path: str | Path) -> str | None:
    """Why the checkpoint directory `path` cannot be resumed from, or None when it can."""
    path = Path(path)
    if path.name.startswith(".tmp_"):
        return "an interrupted write (never marked COMPLETE)"
    marker = path / COMPLETE
    if not marker.is_file():
        return f"no {COMPLETE} marker (its write never finished)"
    try:
        files = json.loads(marker.read_text())["files"]
        listed = [(str(name), int(size)) for name, size in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {COMPLETE} marker is unreadable ({type(e).__name__}: {e})"
    for name, size in listed:
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} is {f.stat().st_size} bytes where {size} were written (truncated or overwritten)"
    return None


def scan(ckpt_dir: str | Path) -> list[tuple[int, Path, str | None]]:
    """(step, path, problem) of every checkpoint directory under ckpt_dir (step_N, .tmp_step_N left by an
    interrupted write, .old_step_N left by an exit while a save of the same step replaced it), oldest first (of one
    step, step_N last); problem is None for those that can be resumed from."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(2)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [(step, p, problem(p)) for step, p in sorted(found, key=lambda sp: (sp[0], not sp[1].name.startswith(".")))]


def completed(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint under ckpt_dir that can be resumed from, oldest first."""
    return [(step, p) for step, p, bad in scan(ckpt_dir) if bad is None]


def latest(ckpt_dir: str | Path) -> Path | None:
    """The newest checkpoint that can be resumed from, or None."""
    done = completed(ckpt_dir)
    return done[-1][1] if done else None


def _failures(e: BaseException, rank: int) -> list[str]:
    """'rank R: Type: message' for each rank an error names (DCP gathers every rank's write error into one)."""
    from torch.distributed.checkpoint import CheckpointException
    if isinstance(e, CheckpointException):
        return [f"rank {r}: {type(x).__name__}: {x}" for r, (x, _) in sorted(e.failures.items())]
    return [f"rank {rank}: {type(e).__name__}: {e}"]


def _together(what: str, fn: Callable[[], None], group: dist.ProcessGroup | None, tmp: Path) -> None:
    """Run this rank's share of one stage of a save; every rank learns whether any failed and then raises the same
    CheckpointError (so none waits for the others in a later collective), after the leader removed `tmp`."""
    from torch.distributed.checkpoint import CheckpointException  # a BaseException
    on, rank = _dist(group)
    errors: list[str] = []
    try:
        fn()
    except (Exception, CheckpointException) as e:
        errors = _failures(e, rank)
    if on:
        every: list[list[str] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, errors, group=group)
        errors = list(dict.fromkeys(err for errs in every for err in errs or ()))
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        prev = latest(tmp.parent)
        raise CheckpointError(f"could not write checkpoint {tmp.parent / tmp.name[len('.tmp_'):]} ({what} in "
                              f"{tmp}): " + "; ".join(errors) +
                              f". The previous checkpoint is untouched: {prev if prev else 'there is none'}")


def save(ckpt_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         scheduler: Any = None, extra: dict[str, Any] | None = None, group: dist.ProcessGroup | None = None,
         keep_last: int | None = None, progress: Progress | None = None) -> Path:
    """Write dir/step_{step} atomically (see the module docstring); keep only the newest `keep_last` if given.
    `progress` is told of each stage written."""
    on, rank = _dist(group)
    note = progress or (lambda _: None)
    root = Path(ckpt_dir)
    final, tmp = root / f"step_{step}", root / f".tmp_step_{step}"

    def prepare() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # the leftovers of an earlier crash
            tmp.mkdir(parents=True)

    def write() -> None:
        import torch.distributed.checkpoint as dcp
        dcp.save(_state(model, optimizer), checkpoint_id=str(tmp), process_group=group, no_dist=not on)
        note(f"checkpoint step_{step}: shards written")
        torch.save({"scheduler": scheduler.state_dict() if scheduler is not None else None, "extra": extra},
                   tmp / f"extra_rank{rank}.pt")

    def finish() -> None:
        if rank != 0:
            return
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        (tmp / COMPLETE).write_text(json.dumps({"step": step, "files": files}, indent=1) + "\n")
        old = root / f".old_step_{step}"
        if final.exists():  # saving the same step again replaces it: moved aside first, so that an exit at any
            shutil.rmtree(old, ignore_errors=True)   # moment leaves a complete step_{step} or .old_step_{step}
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last:
            for _, old in completed(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    _together("creating the directory", prepare, group, tmp)
    _together("writing", write, group, tmp)
    note(f"checkpoint step_{step}: every rank's files written")
    _together("marking it complete", finish, group, tmp)
    return final


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What DCP saves and loads: the model's (sharded) state dict, and the optimizer's when there is one."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
         group: dist.ProcessGroup | None = None) -> dict[str, Any] | None:
    """Restore model (+ optimizer, scheduler) in place from a checkpoint directory; returns this rank's `extra`."""
    on, rank = _dist(group)
    path = Path(path)
    if (bad := problem(path)) is not None:
        raise CheckpointError(f"{path}: cannot resume from this checkpoint: {bad}")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
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
    if (bad := problem(path)) is not None:
        raise CheckpointError(f"{path}: cannot resume from this checkpoint: {bad}")
    side = torch.load(path / f"extra_rank{rank}.pt", weights_only=True)
    return side["extra"] or {}


def export_hf(model: nn.Module, cfg: ModelConfig, path: str | Path, group: dist.ProcessGroup | None = None,
              dtype: torch.dtype | None = None, progress: Progress | None = None) -> None:
    """Write the HF layout (config.json + safetensors) of the current weights. All train ranks call it."""
    from model.hf_io import save_model
    from trainer.fsdp import full_state_dict
    _, rank = _dist(group)
    state = full_state_dict(model)  # collective: every rank gathers, the leader writes
    if progress is not None:
        progress("HF export: weights gathered")
    if rank == 0:
        save_model(state, cfg, path, dtype=dtype)
    _barrier(group)

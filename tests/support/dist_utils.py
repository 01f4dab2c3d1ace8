"""Spawn a small gloo world for a test: `run_world(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in
`world_size` fresh processes with the default group initialised (explicit short timeout), and returns each rank's
return value (anything torch.save can write). A rank that raises fails the test with its traceback; a world that
hangs is killed after `deadline_s`. The ranks enable the optional CPU backend (cpu/), as the entry points do."""
from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.ports import free_port  # noqa: F401 (the tests' port picker)

import cpu

PG_TIMEOUT = timedelta(seconds=60)


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """A gloo subgroup with the test timeout. Every rank of the world must call it, in the same order."""
    return dist.new_group(ranks=ranks, backend="gloo", timeout=PG_TIMEOUT)


def _entry(rank: int, fn: Callable, world_size: int, port: int, outdir: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cpu.enable()
    try:   # a failed rendezvous (a port taken meanwhile, a peer that never came) is reported like an error in fn
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=PG_TIMEOUT)
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(outdir, f"{rank}.pt"))
    except BaseException:
        with open(os.path.join(outdir, f"{rank}.err"), "w") as f:
            f.write(f"rank {rank} of {world_size} (port {port}):\n" + traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Done: leave without the interpreter's teardown, where gloo's threads sometimes abort the process ("terminate
    # called without an active exception", SIGABRT: 1 world in 25 measured, after its result was saved).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_world(fn: Callable, world_size: int, *args: Any, deadline_s: float = 240.0) -> list[Any]:
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), outdir, args), nprocs=world_size,
                                 join=False, start_method="spawn")
        end = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > end:
                    raise TimeoutError(f"{getattr(fn, '__name__', fn)}: world of {world_size} still running "
                                       f"after {deadline_s}s")
        except Exception as e:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            errs = [open(os.path.join(outdir, f)).read() for f in sorted(os.listdir(outdir)) if f.endswith(".err")]
            raise AssertionError("\n".join(errs) or str(e)) from e
        return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False) for r in range(world_size)]

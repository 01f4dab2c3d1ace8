"""A CPU rank's process settings (`setup`, called by `cpu.enable` with the run's config): its cores under
`perf.cpu_affinity = "partition"`, its torch threads, and its C allocator, which keeps freed memory for reuse
instead of handing it back to the OS (`keep_freed_memory`).

PyTorch's CPU tensors come from the C library's malloc, which glibc serves from fresh `mmap`s above a threshold (128
KiB, raised on the fly to the largest block freed so far) and gives back to the OS when freed, or trims from the top of
its heap. A train step allocates and frees the same large activations every micro-batch (16.9 MB for a [16480, 256]
SwiGLU input of the long vs-TRL job), and glibc's thresholds handed part of them back each time, so the next step
touched them again as fresh pages. With blocks up to 32 MiB (glibc's largest mmap threshold on 64-bit) served from the
heap and no trimming, a step reuses its own memory. Measured on one core (bench/results/cpu-vs-trl.md), the long job's
train step (4 micro-batches of 16.5k tokens): minor page faults 23-53k -> 2-3k a step, kernel time 0.03-0.08 ->
0.003-0.006 s, the step 1.01-1.06 -> 0.97-0.99 s; the whole colocated long job's kernel time 0.81-0.90 -> 0.51-0.56 s.
The cost is the usual caching allocator's: a rank keeps its peak heap until it exits (the colocated long job's peak
resident memory stayed within 779-829 MB either way).

Only glibc has `mallopt`; elsewhere (musl, macOS) `keep_freed_memory` changes nothing and returns False.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import TYPE_CHECKING

import torch

from runtime.topology import partition_cores, pin_to_cores

if TYPE_CHECKING:
    from config import Config
    from runtime.topology import Topology

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3       # glibc's malloc.h
MMAP_THRESHOLD_MAX = 32 << 20                     # glibc's ceiling on 64-bit (4 MiB * sizeof(long))
TRIM_THRESHOLD = (1 << 31) - 1                    # an int: never trim below 2 GiB of free heap top


def keep_freed_memory() -> bool:
    """Serve blocks up to 32 MiB from the heap and never trim it (glibc). Returns whether the C library took the
    settings (False where it has no mallopt)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


def setup(cfg: Config, topo: Topology) -> None:
    """The rank's cores (`perf.cpu_affinity = "partition"`: rollout and train ranks of a node on separate cores),
    and on a CPU rank its torch threads (`perf.cpu_threads`, 0: the node's cores over its ranks) and allocator
    (`perf.cpu_keep_freed_memory`)."""
    c = cfg.perf
    if c.cpu_affinity == "partition":
        local, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        node_ranks = list(range(topo.rank - local, topo.rank - local + local_world))
        train_cores, rollout_cores = partition_cores(sorted(os.sched_getaffinity(0)), node_ranks, topo)
        pin_to_cores(rollout_cores if topo.is_rollout else train_cores)
    if topo.device.type == "cpu":
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(c.cpu_threads or max(1, (os.cpu_count() or 1) // local_ranks))
        if c.cpu_keep_freed_memory:
            keep_freed_memory()   # no page faults on each step's activations

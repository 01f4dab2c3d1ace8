"""The run's console progress outside the step bar: one line as the job launches, one per start-up phase and one per
closing phase, so that neither end of a run is silent.

    tidal: starting (config configs/tiny.toml, 4 ranks)          local rank 0 of each node, before torch is imported
    tidal: model ready (2.1 s)                                    global rank 0 from here on; seconds since launch
    tidal: 4 ranks joined (3 train, 1 rollout): runs/tiny-...
    tidal: engines ready: 1 with weights
    tidal: first round started
    ... the step bar (runtime/logger.py) ...
    tidal: saving the final checkpoint (31.0 s)
    tidal: exporting the model to runs/tiny-.../hf
    tidal: shutting down the ranks
    tidal: writing summary.json, timeline.png and curves.png
    run directory: runs/tiny-...  reward 0.110 -> 0.695  (13.0s)

Lines go to stdout (errors and warnings keep stderr), flushed at once. This module imports nothing heavy: train.py
calls `starting` before its torch imports.
"""
from __future__ import annotations

import os
import sys
import time

LAUNCH = time.time()   # this module is imported first thing by train.py: the process's start, to a few ms


def _env_rank(name: str) -> int:
    return int(os.environ.get(name, "0") or 0)


def starting_line(argv: list[str]) -> str:
    """`tidal: starting (config X, N ranks)` from the command line and torchrun's environment."""
    config = "defaults"
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            config = argv[i + 1]
        elif a.startswith("--config="):
            config = a.split("=", 1)[1]
    world = _env_rank("WORLD_SIZE") or 1
    return f"tidal: starting (config {config}, {world} rank{'s' if world != 1 else ''})"


def starting(argv: list[str]) -> None:
    """The launch's first line, on local rank 0 only (one per node); nothing for --help or --check, which answer at
    once on their own."""
    if _env_rank("LOCAL_RANK") != 0 or any(a in ("--help", "-h", "--check") for a in argv):
        return
    print(starting_line(argv), flush=True)


def phase(what: str, rank: int | None = None, timed: bool = False, when: bool = True) -> None:
    """`tidal: WHAT` on global rank 0 (`rank`, else torchrun's RANK), with the seconds since launch if `timed`; nothing
    unless `when` (a phase the config may skip)."""
    if not when or (rank if rank is not None else _env_rank("RANK")) != 0:
        return
    suffix = f" ({time.time() - LAUNCH:.1f} s)" if timed else ""
    print(f"tidal: {what}{suffix}", file=sys.stdout, flush=True)

"""Stalls end the job with a report instead of hanging it.

Every blocking wait in the runtime has a deadline (`cluster.timeout_s`): control-channel gets raise ChannelTimeout
naming the peer, and the train/publish process groups carry the same timeout. When one fires, `report_stall` writes
what this rank was waiting for and every thread's stack to RUN_DIR/stall-rank{R}.txt, prints one line, and leaves
the process with a non-zero status, so torchrun stops the other ranks. A fatal signal (segfault, abort) also dumps
every thread's stack there, through faulthandler.

Fault injection for tests: TIDAL_FAULT_STALL_RANK=R makes global rank R stop responding (its rollout worker
sleeps) once it has received work, as a hung engine would. TIDAL_FAULT_KILL_RANK=R with TIDAL_FAULT_KILL_STEP=S
makes global rank R SIGKILL itself at step S, in the job's first attempt only (torchrun's
TORCHELASTIC_RESTART_COUNT is 0), so a `--max-restarts` job comes back and resumes: a train rank right after its
S-th optimizer step (before that step is published or checkpointed), a rollout rank at the first engine step
under weights of version >= S that finishes a sample (mid-round, before reporting it).
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path
from typing import IO

STALL_EXIT_CODE = 3
_fatal_file: IO[str] | None = None


def install(run_dir: str | Path, rank: int) -> None:
    """Dump every thread's stack to RUN_DIR/fatal-rank{R}.txt if this process dies on a fatal signal."""
    global _fatal_file
    _fatal_file = open(Path(run_dir) / f"fatal-rank{rank}.txt", "w")
    faulthandler.enable(_fatal_file, all_threads=True)


def uninstall() -> None:
    """Clean exit: stop watching and remove the (empty) fatal-signal file."""
    global _fatal_file
    if _fatal_file is not None:
        faulthandler.disable()
        _fatal_file.close()
        path = Path(_fatal_file.name)
        if path.exists() and path.stat().st_size == 0:
            path.unlink()
        _fatal_file = None


def is_timeout(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) or (isinstance(e, RuntimeError) and "Timed out" in str(e))


def report_stall(run_dir: str | Path | None, rank: int, error: BaseException, doing: str) -> None:
    """Write the stall report and leave the process (never returns)."""
    msg = f"rank {rank} stalled while {doing}: {error}"
    if run_dir is not None:
        path = Path(run_dir) / f"stall-rank{rank}.txt"
        with open(path, "w") as f:
            f.write(msg + "\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        msg += f" (stacks of every thread: {path})"
    print(f"error: {msg}", file=sys.stderr, flush=True)
    os._exit(STALL_EXIT_CODE)  # daemon threads may sit in a gloo receive forever; don't wait for them


def maybe_stall(rank: int) -> None:
    """Fault injection (TIDAL_FAULT_STALL_RANK): this rank stops responding."""
    if os.environ.get("TIDAL_FAULT_STALL_RANK") == str(rank):
        while True:
            time.sleep(3600)


def maybe_kill(step: int) -> None:
    """Fault injection (TIDAL_FAULT_KILL_RANK, TIDAL_FAULT_KILL_STEP): this rank dies hard, as on a machine fault
    (no cleanup, no report), at `step` >= S in the first attempt."""
    rank, at = os.environ.get("TIDAL_FAULT_KILL_RANK"), os.environ.get("TIDAL_FAULT_KILL_STEP")
    if rank is None or at is None or rank != os.environ.get("RANK", "0"):
        return
    if step >= int(at) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0"):
        print(f"fault injection: rank {rank} kills itself at step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

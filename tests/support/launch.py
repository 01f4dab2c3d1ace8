"""train.py launched under torchrun from a test, and its metrics read back."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]


def torchrun(nproc: int, *args: str, timeout: float = 400, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess:
    """train.py on `nproc` ranks with the tiny config, no progress bar and no plots (`--log.plots=true` draws
    them); its stdout and stderr, after asserting it succeeded."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
           str(free_port()), "train.py", "--config", "configs/tiny.toml", "--log.progress=false", "--log.plots=false",
           *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def event_rows(path: Path) -> list[dict]:
    """An events.jsonl's events as the dicts of its one-per-line form (a compact log's `requests` lines expanded)."""
    from sched.events import read_events
    return [json.loads(e.to_json()) for e in read_events(path)]

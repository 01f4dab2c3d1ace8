"""Fault injection: a stalled rank ends the job within the deadline, with a report naming it."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.dist


def test_a_stalled_rollout_rank_ends_the_run_with_its_name(tmp_path):
    run = tmp_path / "run"
    deadline = 8
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "--master_port", str(free_port()),
           "train.py", "--config", "configs/tiny.toml", "--log.progress=false", f"--log.dir={run}",
           f"--cluster.timeout_s={deadline}", "--train.steps=5"]
    env = {**os.environ, "TIDAL_FAULT_STALL_RANK": "2", "OMP_NUM_THREADS": "1"}  # rank 2 is the rollout rank
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert elapsed < deadline + 60, elapsed  # start-up (~10-20 s on 2 cores) + the deadline + a margin
    assert "rank 0 stalled" in proc.stderr and "engine 0 (rank 2" in proc.stderr, proc.stderr[-3000:]
    report = (run / "stall-rank0.txt").read_text()
    assert "engine 0 (rank 2, 256 requests)" in report
    assert "Thread" in report and "train.py" in report  # every thread's stack follows the message

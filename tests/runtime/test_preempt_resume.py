"""Graceful preemption on real torchrun ranks (runtime/preempt.py): once two steps of a tiny run are done, SIGTERM
to torchrun (which forwards it to every rank), or the configured second signal (SIGUSR1) to the rollout rank alone;
every rank stops after a checkpoint, with one line naming it and exit code 75; the job run again with
`checkpoint.resume=latest` ends with the uninterrupted run's weights, bit for bit, every group trained once and the
same metrics. Three jobs side by side (the reference and the two preempted ones), then the two resumes. And a
checkpoint slower than the grace period: cut short at the deadline, exit code 75, the last complete one intact."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.preempt import PREEMPTED_EXIT_CODE
from tests.runtime.test_fault_matrix import Job, final_weights, trained_groups
from tests.support.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 8
ARGS = [f"--train.steps={STEPS}", "--rollout.prompts_per_step=8", "--checkpoint.export_hf=false",
        "--log.progress=false", "--log.plots=false", "--cluster.timeout_s=60",
        '--cluster.preempt_signals=["SIGTERM", "SIGUSR1"]']
SAME = ("reward_mean", "accuracy", "response_len_mean", "loss", "grad_norm", "entropy", "samples")   # not timings
DEADLINE_S = 400


def launch(run: Path, *extra: str, faults: str = "") -> tuple[Job, threading.Thread]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "--monitor-interval=0.1",
           "--master_port", str(free_port()), "train.py", "--config", "configs/tiny.toml", f"--log.dir={run}",
           *ARGS, *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "TIDAL_FAULTS": faults},
                            start_new_session=True)
    job = Job(run, [], proc)
    reader = threading.Thread(target=job.read, daemon=True)
    reader.start()
    return job, reader


def steps_logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def rank_pid(torchrun: int, rank: int) -> int:
    """The pid of the worker with RANK=rank among torchrun's children."""
    kids = Path(f"/proc/{torchrun}/task/{torchrun}/children").read_text().split()
    for pid in kids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no rank {rank} among torchrun's children {kids}")


def finish(jobs: list[tuple[Job, threading.Thread]], t0: float) -> None:
    try:
        for job, reader in jobs:
            job.proc.wait(timeout=max(1.0, DEADLINE_S - (time.monotonic() - t0)))
            reader.join(timeout=10)
    finally:
        for job, _ in jobs:
            if job.proc.poll() is None:   # this test's own job: its process group, by id
                os.killpg(job.proc.pid, signal.SIGKILL)


def output(job: Job) -> str:
    return "\n".join(line for _, line in job.lines)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    t0 = time.monotonic()
    ref, term, usr1 = (launch(root / name) for name in ("ref", "term", "usr1"))
    pending = {"term": term[0], "usr1": usr1[0]}
    while pending and time.monotonic() - t0 < DEADLINE_S:   # two steps done: preempt mid-run
        for name, job in list(pending.items()):
            if job.proc.poll() is None and steps_logged(job.run) >= 2:
                if name == "term":
                    os.kill(job.proc.pid, signal.SIGTERM)                      # as a scheduler signals the job
                else:
                    os.kill(rank_pid(job.proc.pid, 2), signal.SIGUSR1)         # one rank only: the rollout rank
                del pending[name]
        time.sleep(0.05)
    finish([ref, term, usr1], t0)
    first = {"term": term[0], "usr1": usr1[0]}
    resumed = {name: launch(root / name, "--checkpoint.resume=latest") for name in first}
    finish(list(resumed.values()), time.monotonic())
    return ref[0], first, {name: job for name, (job, _) in resumed.items()}


@pytest.mark.parametrize("name", ["term", "usr1"])
def test_a_preempted_job_checkpoints_says_so_in_one_line_and_exits_75(runs, name):
    _, first, _ = runs
    job = first[name]
    out = output(job)
    lines = [line for line in out.splitlines() if line.startswith("preempted (")]
    assert len(lines) == 1, out[-6000:]
    sig = "SIGTERM" if name == "term" else "SIGUSR1 on rank 2"
    m = re.match(rf"preempted \({sig}[^)]*\): checkpoint (\S+) saved; exit code {PREEMPTED_EXIT_CODE}; resume with: "
                 rf"torchrun .* --checkpoint\.resume=latest$", lines[0])
    assert m, lines[0]
    step = int(Path(m.group(1)).name.split("_")[1])
    assert 2 <= step < STEPS, lines[0]                       # mid-run: neither lost nor the end
    assert job.proc.returncode != 0
    if name == "usr1":   # torchrun itself was not signalled: it reports each rank's exit code
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
        assert codes and set(codes) == {str(PREEMPTED_EXIT_CODE)}, out[-6000:]
    assert not list(job.run.glob("stall-rank*")) and not list(job.run.glob("failed-rank*")), out[-6000:]


@pytest.mark.parametrize("name", ["term", "usr1"])
def test_the_resumed_job_ends_with_the_uninterrupted_weights_and_metrics(runs, name):
    ref, first, resumed = runs
    job = resumed[name]
    assert ref.proc.returncode == 0, output(ref)[-6000:]
    assert job.proc.returncode == 0, output(job)[-6000:]
    assert re.search(r"restart 0: resuming from \S+/step_\d+", output(job)), output(job)[-3000:]
    a, b = final_weights(ref.run, STEPS), final_weights(job.run, STEPS)
    assert len(a) > 10 and a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a), [k for k in a if not a[k].equal(b[k])]
    once = trained_groups(job.run)
    assert once == trained_groups(ref.run) and set(once.values()) == {1}
    rows = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for run in (ref.run, job.run)]
    assert [r["step"] for r in rows[1]] == list(range(1, STEPS + 1))
    assert [[r[k] for k in SAME] for r in rows[0]] == [[r[k] for k in SAME] for r in rows[1]]


def test_a_checkpoint_that_outlasts_the_grace_period_is_cut_short_and_the_last_complete_one_kept(tmp_path):
    """Every checkpoint from step 2 on is slowed (rank 0 sleeps 3 s at each of its stages); the grace period is 2 s:
    every rank leaves with exit code 75 at the deadline, mid-write, and the newest complete checkpoint is intact."""
    run = tmp_path / "grace"
    slow = " & ".join(f"slow 0 checkpoint {s} 3.0" for s in range(2, STEPS + 1))
    t0 = time.monotonic()
    job, reader = launch(run, "--checkpoint.every=1", f"--checkpoint.keep={STEPS}", "--cluster.preempt_grace_s=2",
                         faults=slow)
    while job.proc.poll() is None and steps_logged(run) < 2 and time.monotonic() - t0 < DEADLINE_S:
        time.sleep(0.05)
    os.kill(rank_pid(job.proc.pid, 2), signal.SIGUSR1)
    finish([(job, reader)], t0)
    out = output(job)
    assert out.count("no checkpoint within cluster.preempt_grace_s = 2s") == 1, out[-6000:]   # rank 0 says it
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    assert codes and set(codes) == {str(PREEMPTED_EXIT_CODE)}, out[-6000:]
    from trainer import checkpoint
    newest = checkpoint.latest(run / "checkpoints")
    assert newest is not None and checkpoint.problem(newest) is None
    assert list((run / "checkpoints").glob(".tmp_step_*")), "the deadline did not cut a write short"

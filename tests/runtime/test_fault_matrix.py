"""The fault matrix on real torchrun processes: freeze (SIGSTOP of the whole process) and kill (SIGKILL) each role
— the rollout rank, a train follower, the leader — at each phase — decoding, weight publication, a train step, a
checkpoint save — plus a hung engine (alive, no progress) and a slow run (two ranks several times slower, alive).

How it fits the suite's budget: kills at every phase but the checkpoint save take one role each (CASES below;
TIDAL_FAULT_MATRIX=full runs all 25 cases), and every case is one attempt of a `torchrun --max-restarts=N` job whose
TIDAL_FAULTS (runtime/faults.py) gives each attempt its fault, so a job walks through a whole column of the matrix
and ends in a clean attempt that finishes the run; the three jobs (freezes, kills, the slow reference) run side by
side, the freezes' deadlines overlapping the others' start-ups. Tiny runs (4 steps of 8 prompts), a 5 s deadline.

Each case must end (torchrun has stopped every rank) within the deadline plus 30 s after the fault, with a named
report: a stall report naming the frozen rank (or the hung one), or, for a kill, torchrun's record of the rank that
died. Every job must end with the slow reference's weights at every step's checkpoint: nothing lost, nothing
trained twice, whatever died where.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.support.dist_utils import free_port
from tests.support.launch import event_rows

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.dist, pytest.mark.slow]

DEADLINE = 5.0
STEPS = 4
ROLES = {2: "rollout", 1: "follower", 0: "leader"}          # ranks of a 3-rank job: 2 train + 1 rollout
ROLES_FULL = {2: "rollout, engine 0", 1: "train", 0: "train leader, controller"}   # as the reports name them
PHASES = ("decode", "publish", "train", "checkpoint")
# A freeze is caught by whichever peer's blocking call has the earliest deadline, which depends on the role and the
# phase: every pair is a case. A kill is seen by torchrun at once whatever the role; what depends on where it
# lands is the resume (nothing lost, nothing trained twice): every role at a checkpoint save (a partial write), one
# role at each other phase (the engine mid-generation, the publisher mid-broadcast, a train peer mid-collective).
# TIDAL_FAULT_MATRIX=full runs every kill too (25 cases instead of 19, ~30% longer).
KILLED_AT = {"decode": 2, "publish": 0, "train": 1}
FULL = os.environ.get("TIDAL_FAULT_MATRIX") == "full"
CASES = [f"freeze {r} {p} 1" for p in PHASES for r in ROLES] + \
    [f"kill {r} {p} 1" for p in PHASES for r in ROLES if FULL or p == "checkpoint" or KILLED_AT[p] == r] + \
    ["hang 2 decode 1"]
CHAINS = {"a": CASES[0::2], "b": CASES[1::2]}   # each walks through freezes and kills: their deadlines interleave
# the follower at train step 2 (2 s at each of its micro-batches of 32 tokens, one group each at least: its 4 groups
# of 8 share a prompt, so 5+ units with the optimizer step) and the engine under version 2 (0.1 s at each engine
# step and each sample scored): each unit of work well under the deadline, each step over it
SLOW = "slow 1 train 2 2.0 & slow 2 decode 2 0.1"
ARGS = [f"--train.steps={STEPS}", "--checkpoint.every=1", f"--checkpoint.keep={STEPS}", "--rollout.prompts_per_step=8",
        "--train.micro_batch_tokens=32", "--checkpoint.export_hf=false", f"--cluster.timeout_s={DEADLINE:g}"]


@dataclass
class Job:
    run: Path
    faults: list[str]
    proc: subprocess.Popen
    lines: list[tuple[float, str]] = field(default_factory=list)   # (arrival time, line) of stdout + stderr

    def read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))


def launch(run: Path, faults: list[str], restarts: int) -> tuple[Job, threading.Thread]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", f"--max-restarts={restarts}",
           "--monitor-interval=0.1", "--master_port", str(free_port()), "train.py", "--config", "configs/tiny.toml",
           "--log.progress=false", "--log.plots=false", f"--log.dir={run}", *ARGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TIDAL_FAULTS": ";".join(faults)}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    job = Job(run, faults, proc)
    reader = threading.Thread(target=job.read, daemon=True)
    reader.start()
    return job, reader


@dataclass
class Case:
    fault: str
    attempt: int
    fired: float | None = None       # when the fault injection line arrived
    ended: float | None = None       # when torchrun reported the attempt's ranks stopped
    first_failure: str = ""          # torchrun's line naming the first rank that failed
    resumed: str = ""                # the next attempt's "restart N: ..." line

    @property
    def kind(self) -> str:
        return self.fault.split()[0]

    @property
    def rank(self) -> int:
        return int(self.fault.split()[1])

    @property
    def name(self) -> str:
        _, rank, phase, _ = self.fault.split()
        return f"{self.kind} {ROLES[int(rank)]} at {phase}"


def cases(job: Job) -> list[Case]:
    """One case per fault, from the job's output in order: fired, the attempt's end, the next attempt's start."""
    out = [Case(f, i) for i, f in enumerate(job.faults)]
    current = None
    for t, line in job.lines:
        if line.startswith("fault injection: "):
            current = next(c for c in out if c.fired is None and line.startswith(f"fault injection: {c.kind} rank "
                                                                                   f"{c.rank} at {c.fault.split()[2]}"))
            current.fired = t
        elif "failed (exitcode:" in line and current is not None and current.ended is None:
            current.ended, current.first_failure = t, line
        elif re.match(r"restart \d+: ", line) and current is not None and not current.resumed:
            current.resumed = line
    return out


def reports(run: Path, attempt: int, kind: str = "stall") -> dict[str, str]:
    """The headline paragraphs of the attempt's stall (or failed) reports, by file name."""
    pattern = f"{kind}-rank*.txt" if attempt == 0 else f"{kind}-rank*.restart{attempt}.txt"
    return {p.name: p.read_text().split("\n\n")[0] for p in run.glob(pattern) if attempt or ".restart" not in p.name}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    t0 = time.monotonic()
    jobs = {"slow": launch(root / "slow", [SLOW], restarts=0),
            **{name: launch(root / name, faults, restarts=len(faults)) for name, faults in CHAINS.items()}}
    try:
        for job, reader in jobs.values():
            job.proc.wait(timeout=max(1.0, 480 - (time.monotonic() - t0)))
            reader.join(timeout=10)
    finally:
        for job, _ in jobs.values():
            if job.proc.poll() is None:   # this test's own job: its process group, by id
                os.killpg(job.proc.pid, signal.SIGKILL)
    result = {name: job for name, (job, _) in jobs.items()}
    lines = [f"fault matrix: {time.monotonic() - t0:.0f}s for the three jobs side by side"]
    for name in CHAINS:
        for c in cases(result[name]):
            took = f"{c.ended - c.fired:.1f}s" if c.fired and c.ended else "?"
            lines.append(f"  {c.name:30s} ended {took:>6s} after the fault; report: {named_report(result[name], c)}; "
                         f"{c.resumed.split(': ', 1)[-1]}")
    print("\n" + "\n".join(lines))
    (root / "summary.txt").write_text("\n".join(lines) + "\n")   # kept with the runs (docs/fault-tolerance.md)
    return result


def named_report(job: Job, c: Case) -> str:
    """Where the case's cause is named: the stall reports that name the frozen or hung rank; for a kill, a survivor's
    report naming the rank that died, or torchrun's record of its death (whichever came: the survivors either see a
    broken connection first, or torchrun stops them first)."""
    if c.kind == "kill":
        died = [name for name, text in reports(job.run, c.attempt, "failed").items()
                if f"rank {c.rank} ({ROLES_FULL[c.rank]}) died" in text]
        torchrun = f"failed (exitcode: -9) local_rank: {c.rank} " in c.first_failure
        return ", ".join(died + ([f"torchrun: exitcode -9 local_rank {c.rank}"] if torchrun else []))
    want = "sent no heartbeat" if c.kind == "freeze" else "alive, no progress"
    return ", ".join(f"{name}: {text.splitlines()[0].split(': ', 1)[1][:70]}" for name, text in
                     sorted(reports(job.run, c.attempt).items()) if f"rank {c.rank} (" in text and want in text)


def output(job: Job) -> str:
    return "\n".join(line for _, line in job.lines)[-8000:]


ALL = [(name, i, f) for name, faults in CHAINS.items() for i, f in enumerate(faults)]


@pytest.mark.parametrize("job_name,attempt,fault", ALL, ids=[f"{j}:{f}" for j, _, f in ALL])
def test_each_fault_ends_its_attempt_in_time_with_a_named_report(matrix, job_name, attempt, fault):
    job = matrix[job_name]
    case = cases(job)[attempt]
    assert case.fired is not None, f"{fault} never fired\n{output(job)}"
    assert case.ended is not None, f"{fault}: the attempt never ended\n{output(job)}"
    assert case.ended - case.fired <= DEADLINE + 30, (case.ended - case.fired, output(job))
    assert case.resumed, f"{fault}: no next attempt\n{output(job)}"
    assert named_report(job, case), (fault, case.first_failure, reports(job.run, attempt),
                                     reports(job.run, attempt, "failed"))
    if case.kind == "kill":   # torchrun sees the death at once
        assert case.ended - case.fired < DEADLINE, case.ended - case.fired
    if case.kind == "freeze":   # the frozen process was killed by the rank that noticed, not left to torchrun
        assert any(f"killed rank {case.rank} " in text for text in reports(job.run, attempt).values())
        assert case.ended - case.fired < DEADLINE + 5, case.ended - case.fired


def final_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    return _load_state_dict_from_keys(storage_reader=FileSystemReader(str(run / "checkpoints" / f"step_{step}")))[
        "model"]


def trained_groups(run: Path) -> Counter:
    events = event_rows(run / "events.jsonl")
    return Counter(g for e in events if e["kind"] == "train_started" for g in e["data"]["groups"])


@pytest.mark.parametrize("job_name", list(CHAINS))
def test_every_job_resumes_to_the_uninterrupted_weights(matrix, job_name):
    job, ref = matrix[job_name], matrix["slow"]
    assert job.proc.returncode == 0 and ref.proc.returncode == 0, output(job)
    for step in range(1, STEPS + 1):
        a, b = final_weights(ref.run, step), final_weights(job.run, step)
        assert len(a) > 10 and a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), (step, [k for k in a if not torch.equal(a[k], b[k])])
    once = trained_groups(job.run)
    assert once == trained_groups(ref.run) and set(once.values()) == {1}
    assert [json.loads(line)["step"] for line in (job.run / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, STEPS + 1))
    # a fault mid-save left an interrupted write behind: a restart named it and resumed from the one before
    full = "\n".join(line for _, line in job.lines)
    assert re.search(r"warning: checkpoint \S+/\.tmp_step_\d+ cannot be resumed from: an interrupted write", full)


def test_a_slow_rank_is_not_declared_dead(matrix):
    """The follower's train step 2 and the engine's round under version 2 each took longer than the deadline (a
    fixed time per call would have fired); each unit of their work did not, so the run went on."""
    job = matrix["slow"]
    assert job.proc.returncode == 0, output(job)
    assert not list(job.run.glob("stall-rank*")), output(job)
    events = event_rows(job.run / "events.jsonl")
    started = next(e["t"] for e in events if e["kind"] == "train_started" and e["version"] == 1)
    done = next(e["t"] for e in events if e["kind"] == "train_step_done" and e["version"] == 2)
    assert done - started > DEADLINE, done - started
    busy = next(e["t"] for e in events if e["kind"] == "engine_busy" and e["version"] == 2)
    idle = next(e["t"] for e in events if e["kind"] == "engine_idle" and e["version"] == 2)
    assert idle - busy > DEADLINE, idle - busy

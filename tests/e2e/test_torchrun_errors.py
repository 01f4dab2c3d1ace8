"""Bad inputs under torchrun, on real ranks: the error is one line, printed once (not once per rank), no rank prints a
traceback, the first rank exits 2 (torchrun stops the others with SIGTERM: they wait for it), and torchrun's own
failure report names the same line as its root cause. These fail before training, so each takes seconds; two ranks
show "once, not once per rank" as well as four. Then `checkpoint.resume = "latest"` in a run directory with no
checkpoint: a fresh start and one line saying so."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from model.tokenizer import build_char_tokenizer
from runtime.rundir import prepare_run_dir
from tests.support.dist_utils import free_port
from tests.support.launch import ROOT, metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
           str(free_port()), "train.py", "--config", "configs/tiny.toml", "--log.progress=false", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def assert_one_clean_error(proc: subprocess.CompletedProcess, prefix: str, needles: list[str]) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    ours = [line for line in out.splitlines() if line.startswith(prefix)]
    assert len(ours) == 1, out[-6000:]                              # once, not once per rank
    line = ours[0]
    assert all(n in line for n in needles), line
    assert "python train.py --config configs/tiny.toml" in line and line.endswith("--check)"), line
    frames = re.findall(r'File "([^"]+)"', out)
    ours = [f for f in frames if f.startswith(str(ROOT)) and "site-packages" not in f]   # a venv may sit in the repo
    assert not ours, frames                                   # the only traceback is torchrun's own
    assert "Connection closed by peer" not in out and "Traceback" not in proc.stdout
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", out)]
    assert codes and set(codes) <= {2, -15} and 2 in codes, codes   # exit 2, or stopped by torchrun
    root = out.split("Root Cause")[-1]
    assert line in root, root[-2000:]                               # torchrun's report ends with our line
    return line


def test_a_misspelt_key_is_one_line_with_the_check_command(tmp_path):
    proc = torchrun(2, "--train.lrr=1e-3", f"--log.dir={tmp_path / 'run'}")
    assert_one_clean_error(proc, "config error:", ["unknown key train.lrr (from command line)",
                                                   "did you mean train.lr?", " --train.lrr=1e-3 "])
    assert not (tmp_path / "run").exists()


def test_a_missing_data_file_is_one_line_on_every_rank(tmp_path):
    build_char_tokenizer("abcdef=", tmp_path / "tok")
    proc = torchrun(2, f"--model.tokenizer={tmp_path / 'tok'}", f"--data.source={tmp_path / 'missing.jsonl'}",
                    "--reward.kind=exact", f"--log.dir={tmp_path / 'run'}")
    assert_one_clean_error(proc, "error:", [f"data.source = '{tmp_path / 'missing.jsonl'}': no such file"])
    assert not (tmp_path / "run").exists()


def test_a_named_checkpoint_that_is_not_there_is_one_line(tmp_path):
    proc = torchrun(2, f"--log.dir={tmp_path / 'run'}", f"--checkpoint.resume={tmp_path / 'run' / 'step_9'}")
    assert_one_clean_error(proc, "config error:", ["checkpoint.resume", "step_9", "is not a directory"])


def test_the_other_ranks_of_a_node_wait_for_torchrun_to_stop_them(monkeypatch, capsys):
    """Were they to exit at once, torchrun could stop the first rank before it printed the line, or name one of them
    as the root cause (its failures' timestamps are whole seconds): this file failed so once in 14 runs."""
    import train
    waits: list[float] = []
    monkeypatch.setattr(train.time, "sleep", waits.append)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert train.fail("config error: x", "configs/tiny.toml", []) == 2
    assert waits == [train.FAIL_WAIT_S] and capsys.readouterr().err == ""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")   # not under torchrun: nobody would stop it
    assert train.fail("config error: x", "configs/tiny.toml", []) == 2 and len(waits) == 1
    monkeypatch.setenv("LOCAL_RANK", "0")         # the first rank prints the line and leaves at once
    assert train.fail("config error: x", "configs/tiny.toml", []) == 2 and len(waits) == 1
    assert capsys.readouterr().err == "config error: x\n"


def test_resume_latest_without_a_checkpoint_starts_afresh_and_says_so(tmp_path):
    run = tmp_path / "run"
    proc = torchrun(2, f"--log.dir={run}", "--checkpoint.resume=latest", "--train.steps=2",
                    "--rollout.prompts_per_step=4", "--checkpoint.export_hf=false")
    assert proc.returncode == 0, proc.stderr[-6000:]
    notes = [line for line in proc.stderr.splitlines() if "checkpoint.resume = 'latest'" in line]
    assert notes == [f"checkpoint.resume = 'latest': no complete checkpoint in {run / 'checkpoints'} yet, starting "
                     "afresh"], proc.stderr[-3000:]
    assert [r["step"] for r in metrics(run)] == [1, 2]


def test_resume_latest_without_a_checkpoint_sets_an_earlier_attempts_logs_aside(tmp_path, capsys):
    """A run directory whose earlier attempt stopped before its first checkpoint: the fresh start's logs begin
    empty (the old lines go to *.discarded.jsonl), so metrics.jsonl reads as one run."""
    from config import load_config
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    cfg = load_config("configs/tiny.toml", [f"--log.dir={run}", "--checkpoint.resume=latest"])
    run_dir, _ = prepare_run_dir(cfg)
    assert Path(run_dir) == run and (run / "metrics.jsonl").read_text() == ""
    assert (run / "metrics.discarded.jsonl").read_text() == json.dumps({"step": 1}) + "\n"
    assert capsys.readouterr().err.count("starting afresh") == 1

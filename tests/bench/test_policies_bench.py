"""bench/policies.py: the reward column (the reward reached on the last quarter of the samples trained), and the
preset x correction matrix end to end on run directories written by a fake launch in place of torchrun."""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from bench import policies
from bench.policies import ROOT, reward_reached
from config import load_config, to_toml
from rl.correction import Correction, correct
from sched.events import Event


def calls(*pairs: tuple[int, float]) -> list[Event]:
    out = [Event("train_started", 0.0, data={"groups": []})]
    for i, (n, r) in enumerate(pairs):
        out.append(Event("train_step_done", float(i), data={"samples": float(n), "reward_mean": r}))
    return out


def test_the_last_quarter_of_the_samples_weighted_by_each_calls_samples():
    # 256 samples in all: the last quarter (64) is the last call alone under sync-sized calls ...
    assert reward_reached(calls((64, 0.1), (64, 0.2), (64, 0.3), (64, 0.9))) == 0.9
    # ... and the last four 16-sample calls under every-U calls: the same samples, the same answer's weighting
    small = [(16, 0.1)] * 12 + [(16, 0.5), (16, 0.7), (16, 0.9), (16, 0.3)]
    assert math.isclose(reward_reached(calls(*small)), (0.5 + 0.7 + 0.9 + 0.3) / 4)
    # calls of unequal size: whole calls from the end until they hold the quarter, weighted by samples
    assert math.isclose(reward_reached(calls((100, 0.0), (40, 0.2), (10, 0.8))), (40 * 0.2 + 10 * 0.8) / 50)
    assert math.isnan(reward_reached([]))


# ------------------------------------------------------------------ the preset x correction matrix, launch faked

LOG_RATIOS = (-0.5, -0.1, 0.0, 0.05, 0.3, 1.0)   # l = log r of six trained tokens, in every step of a fake run


def fake_launch(launched: list[tuple[str, str]]):
    """A stand-in for torchrun that writes the run directory a run of `cmd` would: its config resolved from the
    command line by the parser train.py uses (so an override the bench failed to pass is missing from it), one
    round and one train call per `train.steps` (step k ends at k x 1 s under sync, k x 0.5 s otherwise), and
    metrics rows whose mismatch KL is 0.001 x k and whose correction fractions are rl/correction.py's on
    LOG_RATIOS under the run's own correction, written only when a correction is on (as the trainer does)."""
    def launch(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
        cfg = load_config(ROOT / "configs/tiny.toml", cmd[cmd.index("configs/tiny.toml") + 1:])
        t = cfg.train
        launched.append((cfg.sched.preset, t.correction))
        run = Path(cfg.log.dir)
        run.mkdir(parents=True)
        (run / "config.toml").write_text(to_toml(cfg))
        dt = 1.0 if cfg.sched.preset == "sync" else 0.5
        reward = 0.2 + 0.1 * (t.correction != "none") + 0.05 * (cfg.sched.preset != "sync")
        c = Correction(t.correction, t.correction_low, t.correction_high, t.opsm_delta, t.m2po_tau)
        lr = torch.tensor(LOG_RATIOS)
        out = correct(c, lr, torch.ones_like(lr), torch.arange(len(lr)), torch.ones_like(lr), len(lr))
        events, rows = [], []
        for k in range(1, t.steps + 1):
            events += [Event("round_started", (k - 1) * dt, data={"round": k - 1}),
                       Event("train_started", (k - 0.5) * dt, version=k - 1, data={"groups": [k]}),
                       Event("train_step_done", k * dt, version=k, data={
                           "samples": float(cfg.rollout.group_size), "reward_mean": reward, "response_len_mean": 3.0})]
            row = {"step": k, "mismatch_kl_k3": 0.001 * k}
            if c.active:
                row |= {"correction_clipped_frac": out.clipped.float().mean().item(),
                        "correction_masked_frac": out.masked.float().mean().item()}
            rows.append(row)
        (run / "events.jsonl").write_text("".join(e.to_json() + "\n" for e in events))
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return launch


def table(stdout: str) -> list[dict[str, str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]]


def test_the_matrix_has_a_row_per_preset_and_correction_with_the_runs_own_mismatch_and_masked_fraction(
        tmp_path, monkeypatch, capsys):
    launched: list[tuple[str, str]] = []
    monkeypatch.setattr(policies, "launch", fake_launch(launched))
    policies.main(["--presets", "sync,areal", "--corrections", "none,token_mask", "--rounds", "2", "--repeats", "2",
                   "--out", str(tmp_path), "--", "--train.correction_low=0.9", "--train.correction_high=1.1"])
    # the whole matrix per repeat, alternating, each run with its own correction in its resolved config
    matrix = [("sync", "none"), ("sync", "token_mask"), ("areal", "none"), ("areal", "token_mask")]
    assert launched == matrix + matrix[::-1]
    stdout = capsys.readouterr().out
    rows = table(stdout)
    assert [(r["preset"], r["correction"]) for r in rows] == matrix
    assert all(len(r) == 12 and all(r.values()) for r in rows)
    for r in rows:
        # 2 steps: the mean of the steps' mismatch_kl_k3, 0.001 and 0.002
        assert r["KL k3"] == "1.50e-03", r
        assert r["reward"] == ("0.200", "0.300", "0.250", "0.350")[matrix.index((r["preset"], r["correction"]))]
        if r["correction"] == "none":
            assert r["clipped"] == r["masked"] == "-", r
        else:  # r = exp(l) outside [0.9, 1.1] for l = -0.5, 0.3, 1.0: 3 of the 6 tokens, none clipped
            assert (r["clipped"], r["masked"]) == ("0.000", "0.500"), r
        # sync's 2 steps take 2 s, areal's 1 s; 2 x 8 samples, 3 tokens each
        sync = r["preset"] == "sync"
        want = ("2.00", "8.0", "24.0") if sync else ("1.00", "16.0", "48.0")
        assert (r["loop s"], r["samples/s"], r["tokens/s"]) == want, r
        assert r["vs sync"] == ("1.00x" if sync else "2.00x")
    last = stdout.rstrip().splitlines()[-1]
    assert last == "reward reached: best areal+token_mask 0.350; speedup vs sync (none): areal 2.00x"


def test_a_run_whose_config_lost_its_correction_stops_the_bench(tmp_path, monkeypatch):
    launched: list[tuple[str, str]] = []
    real = fake_launch(launched)
    monkeypatch.setattr(policies, "launch", lambda cmd, timeout: real(
        [a for a in cmd if not a.startswith("--train.correction=")], timeout))
    with pytest.raises(SystemExit, match="train.correction = 'none', not 'tis'"):
        policies.main(["--presets", "sync", "--corrections", "tis", "--rounds", "1", "--out", str(tmp_path)])


def test_without_corrections_the_runs_and_the_output_are_todays(tmp_path, monkeypatch, capsys):
    launched: list[tuple[str, str]] = []
    cmds: list[list[str]] = []
    real = fake_launch(launched)
    monkeypatch.setattr(policies, "launch", lambda cmd, timeout: cmds.append(cmd) or real(cmd, timeout))
    policies.main(["--presets", "sync,areal", "--rounds", "2", "--out", str(tmp_path)])
    assert not any(a.startswith("--train.correction") for cmd in cmds for a in cmd)
    out = capsys.readouterr().out.rstrip().splitlines()
    assert "| " not in "\n".join(out) and out[-1] == "speedup vs sync: areal 2.00x"
    assert out[-5].split() == ["preset", "loop", "s", "process", "s", "samples/s", "tokens/s", "reward", "trainer",
                               "wait", "load", "vs", "sync"]

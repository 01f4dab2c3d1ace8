"""A resumed run's console and summary continue the run (runtime/logger.py, runtime/rundir.py): the step bar starts at
the checkpoint's step, and the summary's rewards are over every step's row, the earlier attempts' included. On real
ranks: tests/e2e/test_train_e2e.py's resume test."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

from runtime.logger import MetricsLogger
from runtime.rundir import run_rows
from sched.events import Event


def config(steps: int, progress: bool = True) -> SimpleNamespace:
    return SimpleNamespace(log=SimpleNamespace(every=1, progress=progress, wandb=False, request_events="compact"),
                           train=SimpleNamespace(steps=steps))


def test_the_bar_of_a_resumed_run_starts_at_its_checkpoint_step(tmp_path, capsys):
    log = MetricsLogger(config(4), tmp_path, num_engines=1)
    log.resumed(2)
    log.write(Event("weights_loaded", 0.1, engine=0, version=2))
    log.write(Event("round_started", 0.2, data={"round": 2}))
    for step in (3, 4):
        log.write(Event("train_step_done", 0.3 * step, version=step, data={"reward_mean": 0.1 * step}))
    log.close()
    captured = capsys.readouterr()
    shown = re.findall(r"(\d+)/4", captured.err)   # tqdm skips redraws closer than 0.1 s: the first and last stay
    assert shown[0] == "2" and shown[-1] == "4" and "0/4" not in captured.err, captured.err
    lines = captured.out.splitlines()
    assert lines[0].startswith("tidal: engines ready: 1 with weights (")
    assert lines[1] == "tidal: first round started (resumed at step 2)"
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [3, 4]


def test_the_summary_rows_are_the_whole_run(tmp_path):
    earlier = [{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier))
    resumed = [{"step": 3, "reward_mean": 0.3}, {"step": 4, "reward_mean": 0.4}]
    assert run_rows(tmp_path, resumed) == earlier + resumed
    # an attempt from step 1 (a fresh run, even in a directory an older run left rows in) is the whole run itself
    fresh = [{"step": 1, "reward_mean": 0.5}]
    assert run_rows(tmp_path, fresh) == fresh
    assert run_rows(tmp_path / "nowhere", resumed) == resumed

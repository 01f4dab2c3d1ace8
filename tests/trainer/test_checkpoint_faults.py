"""Checkpoints under faults (trainer/checkpoint.py, runtime/rundir.py): a newest checkpoint that is incomplete or
damaged on disk is skipped with a warning naming it, and the run resumes from the one before; a write that fails
(the file-size limit of a full disk, a path that cannot be a directory) names the path and leaves the previous
checkpoint the newest usable one. A failing write on one rank of several is in tests/trainer/test_trainer_dist.py."""
from __future__ import annotations

import json
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch

from config import TrainConfig, load_config
from runtime.rundir import prepare_run_dir, resume_path
from tests.support.trainer import make_groups, tiny_model
from trainer import Trainer
from trainer.checkpoint import COMPLETE, CheckpointError, latest, problem, scan

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def three(tmp_path) -> tuple[Trainer, Path]:
    """A trainer that saved step_1..step_3 under tmp_path/run/checkpoints."""
    root = tmp_path / "run" / "checkpoints"
    tr = Trainer(tiny_model(), TrainConfig(lr=1e-2))
    for s in range(3):
        tr.train_step(make_groups(s))
        tr.save_checkpoint(root, extra={"s": s})
    return tr, root


def damage(ckpt: Path, how: str) -> str:
    """Damage a checkpoint directory the way `how` says; the words its problem must contain."""
    shard = next(ckpt.glob("*.distcp"))
    if how == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:100])
        return f"{shard.name} is 100 bytes where"
    if how == "missing side file":
        (ckpt / "extra_rank0.pt").unlink()
        return "extra_rank0.pt is missing"
    if how == "no marker":
        (ckpt / COMPLETE).unlink()
        return f"no {COMPLETE} marker"
    (ckpt / COMPLETE).write_text("step 3\n")   # a marker without its manifest
    return f"its {COMPLETE} marker is unreadable"


@pytest.mark.parametrize("how", ["truncated shard", "missing side file", "no marker", "garbage marker"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(three, how):
    tr, root = three
    assert problem(root / "step_3") is None and latest(root) == root / "step_3"
    words = damage(root / "step_3", how)
    assert words in problem(root / "step_3")
    assert latest(root) == root / "step_2"
    assert [(step, bad is None) for step, _, bad in scan(root)] == [(1, True), (2, True), (3, False)]
    fresh = Trainer(tiny_model(seed=3), TrainConfig(lr=1e-2))
    assert fresh.load_checkpoint(latest(root)) == {"s": 1} and fresh.step == 2
    with pytest.raises(CheckpointError, match="step_3: cannot resume from this checkpoint"):
        fresh.load_checkpoint(root / "step_3")


def test_a_restarted_run_warns_naming_the_skipped_checkpoints(three, monkeypatch, capsys):
    tr, root = three
    run = root.parent
    damage(root / "step_3", "truncated shard")
    shutil.copytree(root / "step_2", root / ".tmp_step_4")            # a write interrupted by a crash
    cfg = load_config(None, [f"--log.dir={run}", "--log.progress=false"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume_path(cfg) == root / "step_2"
    (run / "events.jsonl").write_text("")
    (run / "metrics.jsonl").write_text("")
    prepare_run_dir(cfg)
    err = capsys.readouterr().err
    assert f"warning: checkpoint {root / '.tmp_step_4'} cannot be resumed from: an interrupted write" in err
    assert f"warning: checkpoint {root / 'step_3'} cannot be resumed from: " \
           f"{next((root / 'step_3').glob('*.distcp')).name} is 100 bytes" in err
    assert f"falling back to {root / 'step_2'}" in err and f"resuming from {root / 'step_2'}" in err
    explicit = load_config(None, [f"--log.dir={run}", f"--checkpoint.resume={root / 'step_3'}"])
    with pytest.raises(FileNotFoundError, match="step_3' cannot be resumed from: .* is 100 bytes"):
        resume_path(explicit)


def test_a_write_past_the_file_size_limit_names_the_path_and_keeps_the_previous(three):
    """RLIMIT_FSIZE makes every write past 4 KiB fail with EFBIG, as a full disk fails with ENOSPC."""
    tr, root = three
    tr.train_step(make_groups(7))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        with pytest.raises(CheckpointError) as err:
            tr.save_checkpoint(root, extra={"s": 9})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    msg = str(err.value)
    assert f"could not write checkpoint {root / 'step_4'} (writing in {root / '.tmp_step_4'})" in msg, msg
    assert "rank 0: OSError: [Errno 27] File too large" in msg, msg
    assert f"The previous checkpoint is untouched: {root / 'step_3'}" in msg
    assert not (root / ".tmp_step_4").exists() and latest(root) == root / "step_3"
    fresh = Trainer(tiny_model(seed=3), TrainConfig(lr=1e-2))
    assert fresh.load_checkpoint(latest(root)) == {"s": 2}


def test_a_checkpoint_directory_that_cannot_be_made_is_named(tmp_path):
    blocker = tmp_path / "ckpts"
    blocker.write_text("a file where the checkpoint directory should be")
    tr = Trainer(tiny_model(), TrainConfig(lr=1e-2))
    tr.train_step(make_groups(0))
    with pytest.raises(CheckpointError, match=rf"could not write checkpoint {blocker / 'step_1'} \(creating the "
                                              rf"directory in {blocker / '.tmp_step_1'}\): rank 0: "
                                              rf"(NotADirectoryError|FileExistsError)"):
        tr.save_checkpoint(blocker)
    assert blocker.read_text().startswith("a file")


def test_the_manifest_lists_every_file_with_its_size(three):
    _, root = three
    manifest = json.loads((root / "step_3" / COMPLETE).read_text())
    assert manifest["step"] == 3
    on_disk = {str(p.relative_to(root / "step_3")): p.stat().st_size for p in (root / "step_3").rglob("*")
               if p.is_file() and p.name != COMPLETE}
    assert manifest["files"] == on_disk and ".metadata" in on_disk and "extra_rank0.pt" in on_disk
    assert torch.load(root / "step_3" / "extra_rank0.pt", weights_only=True)["extra"]["extra"] == {"s": 2}

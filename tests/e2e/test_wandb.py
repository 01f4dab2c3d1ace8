"""wandb, exercised: a tiny run with `log.wandb = true` in offline mode (no network, no account) writes wandb's
offline run files, and reading them back finds every step's metrics, the timeline image and the run config."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

wandb = pytest.importorskip("wandb")
pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32 * 1024  # wandb's .wandb file: a 7-byte header, then LevelDB-style log records in 32 KiB blocks
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf Records of an offline run file (wandb writes it from its Go core and ships no Python reader)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a record header is zero padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            yield pb.Record.FromString(parts)
            parts = b""


def items(entries: Any) -> dict[str, Any]:
    """{key: value} of history/config items; a nested key (timeline/path) becomes nested dicts."""
    out: dict[str, Any] = {}
    for i in entries:
        *parents, last = list(i.nested_key) or [i.key]
        node = out
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = json.loads(i.value_json)
    return out


@pytest.mark.slow
def test_a_tiny_run_reaches_wandb_offline_files_with_metrics_timeline_and_config(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
           "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    proc = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.toml", "--cluster.colocate=true",
                           "--cluster.world_size=1", "--train.steps=3", "--log.progress=false", "--log.wandb=true",
                           "--log.wandb_project=tidal-test", f"--log.dir={run}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, list(run.rglob("*"))
    history: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    for r in wandb_records(files[0]):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            row = items(r.history.item)
            history.setdefault(int(row["_step"]), {}).update(row)
        elif kind in ("run", "config"):
            config.update(items(r.run.config.update if kind == "run" else r.config.update))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and sorted(history) == [1, 2, 3]
    for m in metrics:  # every metrics.jsonl value reached wandb at its step
        assert all(history[m["step"]][k] == pytest.approx(v) for k, v in m.items() if k != "step"), m
    image = history[3]["timeline"]
    assert image["_type"] == "image-file" and (files[0].parent / "files" / image["path"]).is_file()
    assert config["train"]["steps"] == 3 and config["cluster"]["colocate"] is True
    assert config["sched"]["preset"] == "sync" and config["run_dir"] == str(run)
    assert config["model"]["preset"] == "tiny" and config["log"]["wandb_project"] == "tidal-test"

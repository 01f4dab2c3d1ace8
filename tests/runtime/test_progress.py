"""The console's start-up and closing lines (runtime/progress.py): the launch's first line comes before torch is
imported, once per node. The phases' order on real ranks: tests/e2e/test_train_e2e.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runtime.progress import phase, starting, starting_line
from tests.support.launch import ROOT

# train.py run as torchrun runs it, with an import hook that says when torch's import begins; a bad learning rate
# ends it at the config, before any process group
SPY = """
import runpy, sys
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("importing torch", flush=True)
        return None
sys.meta_path.insert(0, Spy())
sys.argv = ["train.py", "--config", "configs/tiny.toml", "--train.lr=-1"]
runpy.run_path("train.py", run_name="__main__")
"""


def launch(local_rank: int) -> list[str]:
    env = {**os.environ, "WORLD_SIZE": "4", "RANK": str(local_rank), "LOCAL_RANK": str(local_rank)}
    proc = subprocess.run([sys.executable, "-c", SPY], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    return proc.stdout.splitlines()


def test_the_first_line_comes_before_torch_is_imported_on_local_rank_zero_only():
    """torch's imports and the ranks' rendezvous took 17-20 s of a silent console on a loaded machine; the first line
    is now printed before the first of them."""
    lines = launch(0)
    assert lines[:2] == ["tidal: starting (config configs/tiny.toml, 4 ranks)", "importing torch"], lines
    assert launch(1)[:1] == ["importing torch"]


def test_the_starting_line_names_the_config_and_ranks(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert starting_line(["--config=configs/x.toml"]) == "tidal: starting (config configs/x.toml, 1 rank)"
    monkeypatch.delenv("WORLD_SIZE")
    assert starting_line([]) == "tidal: starting (config defaults, 1 rank)"
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    starting(["--check"])   # --check and --help answer at once, with their own output
    starting(["--help"])
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("rank,shown", [(0, True), (2, False)])
def test_phases_print_on_global_rank_zero(rank, shown, capsys):
    phase("model ready", rank, timed=True)
    out = capsys.readouterr().out
    assert out.startswith("tidal: model ready (") == shown and out.endswith(" s)\n") == shown, out

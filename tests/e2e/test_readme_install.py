"""The README's install lines: the Quickstart's two commands (what CI runs), and the CPU-only alternative beside them
pinning the same PyTorch version from PyTorch's CPU wheel index."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def quickstart_commands() -> list[str]:
    block = README.split("## Quickstart", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()


def test_quickstart_is_the_two_commands_ci_runs():
    install, run = quickstart_commands()
    assert install == 'pip install torch==2.13.0 && pip install -e ".[dev]"'
    assert run == "torchrun --nproc_per_node=4 train.py --config configs/tiny.toml"
    assert re.search(r"pip install -q torch==2\.13\.0\b", (ROOT / ".ci" / "run").read_text())


def test_ci_runs_the_readme_s_full_suite_command():
    tests = README.split("Tests (CPU only", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    full = tests[0].split(" && ")[-1].split("#")[0].strip()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert full.startswith("python -m pytest tests") and ci == "exec python3 -m pytest " + full.split("pytest ", 1)[1]


def test_cpu_only_install_line_pins_the_same_torch_from_the_cpu_index():
    pinned = re.search(r"torch==([\d.]+)", quickstart_commands()[0]).group(1)
    cpu = re.findall(r"pip install torch==([\d.]+) --index-url https://download\.pytorch\.org/whl/cpu", README)
    assert cpu == [pinned], cpu


def test_readme_stays_short():
    assert len(README.splitlines()) <= 250

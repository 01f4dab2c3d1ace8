"""`perf.cpu_backend`, the one switch of the optional C backend: `cpu.enable(cfg)` registers the CPU engine, kernels
and train ops into the core's registries under "c" and nothing under "torch", where a CPU engine is the core's own
LLMEngine. Each case runs in a fresh interpreter (this session's conftest has enabled the backend already)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import cpu
from config import load_config
from engine import EngineConfig, LLMEngine
from engine.engine import ENGINES
from engine.fused import FAMILIES
from kernels.dispatch import REGISTRY
from model import ModelConfig, Transformer
from trainer.fused import BACKENDS
cfg = load_config(None, sys.argv[1:])
cpu.enable(cfg)
model = Transformer(ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                                num_kv_heads=2, head_dim=8, tie_word_embeddings=True)).init_weights(std=0.1, seed=0)
eng = LLMEngine(model, EngineConfig())
print(json.dumps({"engines": len(ENGINES), "families": len(FAMILIES), "train": len(BACKENDS),
                  "kernels": sorted(i.backend for impls in REGISTRY.values() for i in impls),
                  "engine": type(eng).__name__}))
"""


def probe(*overrides: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, *overrides], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_cpu_backend_key_registers_the_c_backend_or_nothing(backend):
    got = probe(f"--perf.cpu_backend={backend}")
    if backend == "c":
        assert got["engines"] == got["families"] == got["train"] == 1
        assert got["kernels"] == ["cpu_c"] * 4 and got["engine"] == "CpuEngine"
    else:
        assert got == {"engines": 0, "families": 0, "train": 0, "kernels": [], "engine": "LLMEngine"}


def test_an_unknown_cpu_backend_is_a_config_error():
    out = subprocess.run([sys.executable, "-c", PROBE, "--perf.cpu_backend=native"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "perf.cpu_backend" in out.stderr

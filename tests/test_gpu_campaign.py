"""bench/gpu.py --dry-run: the whole GPU campaign's code paths on CPU at tiny sizes, each section in its own process,
so the campaign cannot die on its first GPU minute; and --report turns its results file into RESULTS.md rows."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu import SECTIONS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_campaign_dry_run_runs_every_section_and_reports(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    sec = res["sections"]
    assert list(sec) == list(SECTIONS) and res["meta"]["dry_run"] is True
    assert {k: v["status"] for k, v in sec.items()} == {k: "ok" for k in SECTIONS}, proc.stdout[-4000:]
    r = {k: v["results"] for k, v in sec.items()}
    assert r["tests"]["counts"]["collected"] >= 100  # the GPU-marked tests collect
    decode = r["kernels"]["decode_vs_copy_bw"]
    assert len(decode) == 3 and all(v > 0 for v in decode.values())
    assert r["kernels"]["logprob"]["memory_vs_naive"] > 0 and r["kernels"]["copy_gbs"] > 0
    assert r["engine"]["engine_tok_s"] > 0 and r["engine"]["vs_hf_cb"] > 0 and r["engine"]["roofline"] > 0
    assert [m["checkpointing"] for m in r["train"]["modes"]] == [False, True]
    assert all(m["mfu"] > 0 for m in r["train"]["modes"])
    g = r["grpo_step"]
    assert list(g["seconds"]) == ["generation", "scoring", "logprob_recompute", "training", "weight_update"]
    assert all(v > 0 for v in g["seconds"].values()) and g["samples"] == 6
    assert g["logprob_mismatch_max"] < 1e-4  # fp32: the engine's behaviour log-probs are the trainer's
    e = r["e2e"]
    assert e["steps"] == 2 and e["check"].startswith("ok: configs/qwen3-0.6b-gsm8k.toml passes --check")
    assert e["calibration"]["train_s_per_token_one_rank"] > 0
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("gpu_campaign: engine ") and "x hf continuous batching" in lines[-1]
    assert any(ln.startswith("| GPU-marked tests (`pytest -m gpu`) | ") for ln in lines)
    assert any(ln.startswith("### GPU campaign — `python bench/gpu.py --dry-run") for ln in lines)
    again = subprocess.run([sys.executable, "bench/gpu.py", "--report", str(out)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == lines[-1]

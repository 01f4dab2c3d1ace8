"""bench/gpu.py --dry-run: the whole GPU campaign's code paths on CPU at tiny sizes, each section in its own process,
so the campaign cannot die on its first GPU minute; and --report turns its results file into the rows of its
report (bench/results/gpu-<device>.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_sections import DRY_COMPILES, SECTIONS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_campaign_dry_run_runs_every_section_and_reports(tmp_path):
    out = tmp_path / "gpu.json"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # ~64-90 s of CPU (user + sys), two sections at a time: the wall limit leaves room for a shared machine
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env={**os.environ, "TMPDIR": str(tmp)})
    left = [p.name for p in tmp.iterdir() if p.name.startswith("tidal-")]
    assert not left, f"the campaign left its temporary run directories behind: {left}"   # 300 MB a run once
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
    e = r["engine"]
    assert e["engine_tok_s"] > 0 and e["vs_hf_cb"] > 0 and e["vs_unfused"] > 0
    assert 0 < e["decode_floor_fraction"] and 0 < e["run_floor_fraction"] and e["floor_s"] > 0
    assert r["versions"]["spec"]["name"] == "CPU (dry run)"
    runs = r["train"]["runs"]
    assert [x["micro_batch_tokens"] for x in runs] == [64, 128]
    compiled = [(False, False, True)] if DRY_COMPILES else []   # at the first size, where a C++ compiler is
    if DRY_COMPILES:   # the compile is in the compiled mode's first warm-up step, not in its timed steps
        first = runs[0]["modes"][1]
        assert first["runs_warmup_s"][0] > 5 * first["step_s"], first
    assert [[(m["checkpointing"], m["fused_kernels"], m["compiled"]) for m in x["modes"]] for x in runs] == \
        [[(False, True, False), *compiled], [(False, True, False)]]
    assert all(m["mfu"] == pytest.approx(m["tflops"] / 1.0) and m["tflops"] > 0 for x in runs for m in x["modes"])
    g = r["grpo_step"]
    assert list(g["seconds"]) == ["generation", "scoring", "logprob_recompute", "training", "weight_update"]
    assert all(v > 0 for v in g["seconds"].values()) and g["samples"] == 6
    assert all(g["tflops"][k] > 0 for k in ("generation", "logprob_recompute", "training"))
    assert g["tflops"]["scoring"] is None and g["micro_batches"] >= 1
    prof = g["training_profile"]
    assert "aten::mm" in prof["table"] and prof["host_s"] > 0 and prof["wall_s"] > 0
    assert g["logprob_mismatch_max"] < 1e-4  # fp32: the engine's behaviour log-probs are the trainer's
    assert [x["of"] for x in g["training_by_logprob_chunk"]] == ["default", "cpu"]
    assert all(x["s"] > 0 and x["chunk"] >= 16 for x in g["training_by_logprob_chunk"])
    e = r["e2e"]
    assert e["steps"] == 2 and e["check"].startswith("ok: configs/qwen3-0.6b-gsm8k.toml passes --check")
    assert e["calibration"]["train_s_per_token_one_rank"] > 0
    assert e["resume"]["ok"] and e["resume"]["steps"] == 3 and e["resume"]["checkpoints"][-1] == "step_2"
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("gpu_campaign: trainer MFU ") and "engine floor " in lines[-1]
    assert any(ln.startswith("| GPU-marked tests (`pytest -m gpu`)") for ln in lines)
    assert any(ln.startswith("| trainer, tiny shape, 128-token micro-batches, checkpointing off") for ln in lines)
    assert any(ln.startswith("| trainer, tiny shape, 64-token micro-batches, checkpointing off, each block compiled")
               for ln in lines) == DRY_COMPILES
    assert any(ln.startswith("| same, checkpointing off: the fused kernels vs each block compiled")
               for ln in lines) == DRY_COMPILES
    assert any(ln.startswith("| same, training phase: MFU (TFLOP/s) |") for ln in lines)
    assert any(ln.startswith("| same, training phase again, warm, the logprob head in ") for ln in lines)
    assert any(ln.startswith("### GPU campaign — `python bench/gpu.py --dry-run") for ln in lines)
    again = subprocess.run([sys.executable, "bench/gpu.py", "--report", str(out)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == lines[-1]


# ---- what the first GPU campaign (2026-11-24, H100) found: each would have been caught by one of these ----------
def test_transformers_continuous_batching_fails_fast_and_named(monkeypatch):
    """On the H100, transformers 5.17's continuous batching logged an error in its generation thread and made no
    more progress; the bench waited on it with no deadline until the section's 420 s limit killed it, and nothing
    the section had measured came back. Now a logged error followed by a stall ends the wait, named by the error
    (a logged error with progress after it is let be), and a deadline bounds it."""
    import logging
    import time
    from types import SimpleNamespace

    from bench import engine as be

    class Manager:
        def __init__(self, fail: bool):
            self.fail, self.added, self.calls = fail, 0, 0

        def add_request(self, *a, **k):
            self.added += 1

        def get_result(self, timeout):
            self.calls += 1
            if self.fail == "harmless" and self.calls == 1:
                logging.getLogger("ContinuousBatchingLogger").error("no psutil: no memory breakdown")
            if self.fail == "harmless":
                return SimpleNamespace(is_finished=lambda: True)
            if self.fail and self.calls == 1:
                logging.getLogger("ContinuousBatchingLogger").error("Error in generation loop: size mismatch")
            time.sleep(0.01)
            return None

        def is_running(self):
            return True

    class HF:
        def __init__(self, fail):
            self.manager = Manager(fail)

        def continuous_batching_context_manager(self, **k):
            from contextlib import nullcontext
            return nullcontext(self.manager)

    args = SimpleNamespace(device="cpu")
    before = list(logging.getLogger("ContinuousBatchingLogger").handlers)  # transformers may have put its own there
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="failed after 0 of 3 requests: Error in generation loop: size mismatch"):
        be.run_hf_continuous(HF(True), [[1], [2], [3]], [1, 1, 1], args, deadline_s=30, stall_s=0.2)
    assert be.run_hf_continuous(HF("harmless"), [[1], [2], [3]], [1, 1, 1], args, stall_s=0.2) > 0
    with pytest.raises(TimeoutError, match="finished 0 of 3 requests in 0 s") as e:
        be.run_hf_continuous(HF(False), [[1], [2], [3]], [1, 1, 1], args, deadline_s=0.2)
    assert isinstance(e.value, be.Unfinished) and (e.value.done, e.value.total) == (0, 3) and e.value.secs >= 0.2
    assert time.perf_counter() - t0 < 5
    assert logging.getLogger("ContinuousBatchingLogger").handlers == before  # the bench's handler is gone again


def test_static_generate_stops_before_a_batch_that_would_end_past_its_deadline():
    """The static peer is judged from its batches so far: a batch that would end past the deadline is not started,
    and `Unfinished` names the requests done and the time spent (a lower bound on its time)."""
    import time
    from types import SimpleNamespace

    import bench.engine as be

    class HF:
        calls = 0

        def generate(self, ids, **k):
            HF.calls += 1
            time.sleep(0.1)

    args = SimpleNamespace(device="cpu", hf_batch_size=2)
    prompts, outs = [[1, 2]] * 6, [3] * 6
    with pytest.raises(be.Unfinished, match="static generate finished 2 of 6 requests") as e:
        be.run_hf_generate(HF(), prompts, outs, args, deadline_s=0.15)
    assert (e.value.done, e.value.total) == (2, 6) and 0.1 <= e.value.secs < 0.15 and HF.calls == 2  # warm-up + 1
    assert be.run_hf_generate(HF(), prompts, outs, args, deadline_s=10) >= 0.3 and HF.calls == 2 + 4


def test_each_section_is_saved_as_it_ends(monkeypatch, tmp_path):
    """A device call cut off at its limit returns only what was written: the campaign used to write its results
    file once, at the end. Now it is written after every section, so finished sections survive a later one's kill."""
    import bench.gpu as gpu

    def fake_run(cmd, **k):
        name = cmd[cmd.index("--section") + 1]
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({"status": "ok", "results": {"name": name}}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(gpu.subprocess, "run", fake_run)
    seen: list[list[str]] = []
    results: dict = {"sections": {}}
    gpu.run_sections(["kernels", "train", "engine"], False, results, lambda: seen.append(list(results["sections"])))
    assert seen == [["kernels"], ["kernels", "train"], ["kernels", "train", "engine"]]


def test_train_bench_counts_the_flops_of_what_it_packs():
    """bench/train.py's MFU counts every packed token once: unshared, the closed form over (prompt, response)
    pairs; with shared prompts, one prompt per family and micro-batch, and its children's query-key pairs over it."""
    from bench.train import micro_batch_flops, shape, synthetic_groups, train_flops
    from trainer.batch import build_samples, collate
    from rl.advantages import compute_advantages
    m = shape("tiny")
    groups = synthetic_groups(8, 5, 7, m.vocab_size, group_size=4)
    samples = build_samples(compute_advantages(groups, "std", False))
    assert all(s.tokens[:5] == samples[4 * (i // 4)].tokens[:5] for i, s in enumerate(samples))  # groups share
    unshared = collate(samples, share_prompts=False)
    assert micro_batch_flops(m, [unshared]) == pytest.approx(train_flops(m, [(5, 7)] * 8))
    shared = collate(samples, share_prompts=True)
    assert shared.input_ids.numel() == 2 * 5 + 8 * 6
    dense = m.num_layers * (m.hidden_size * (2 * m.num_heads + 2 * m.num_kv_heads) * m.head_dim
                            + 3 * m.hidden_size * m.intermediate_size)       # multiply-adds per token
    pair = 4 * m.num_layers * m.num_heads * m.head_dim                       # FLOPs per causal query-key pair
    saved = 3 * 6 * (5 * 2 * dense + 5 * 5 / 2 * pair)  # 6 of the 8 prompt copies: their tokens and their pairs
    assert micro_batch_flops(m, [shared]) == pytest.approx(train_flops(m, [(5, 7)] * 8) - saved)


def test_report_gives_no_ratio_for_a_peer_that_did_not_finish():
    """A peer still running at its deadline is "did not finish in N s", never a ratio: the bench once stopped its
    peers at 12x our time and reported ">= 12.1x", a figure that measured its own cap. The transformers peer is a
    labelled extra; the engine's target is its fraction of the floor."""
    import bench.gpu_report as gpu_report
    import bench.gpu_sections as sections
    assert not hasattr(sections, "PEER_CAP_X")
    eng = dict(shape="qwen3-0.6b", prompts=256, lengths=[100, 1024], engine_tok_s=14947.0, engine_s=9.79,
               hf_batch=64, decode_gbs=2265.0, copy_gbs=4271.0, hf_cb_unfinished=dict(done=80, total=256, secs=118.0))
    results = {"meta": {"date": "d", "device": "NVIDIA H200", "torch": "t", "transformers": "x", "triton": "y",
                        "commit": "c", "command": "cmd", "campaign_s": 1.0, "dry_run": False},
               "sections": {"engine": {"status": "ok", "results": eng}}}
    rows = gpu_report.rows(results)
    row = next(r for r in rows if r.startswith("| extra peer"))
    assert "did not finish in 118 s (80 of 256 requests)" in row and "x" not in row.split("|")[2].replace("x ", "")
    floor = next(r for r in rows if "whole run vs its floor" in r)
    assert floor.split("|")[2].strip().startswith("0.36") and floor.endswith("| **no** |")
    decode = next(r for r in rows if "decode steps only" in r)
    assert decode.split("|")[2].strip().startswith("0.47 (2265 GB/s; 0.53 of the 4271 GB/s copy")
    assert "engine floor 0.36 whole run, 0.47 decode" in gpu_report.headline(results)


def test_device_specs_come_from_the_datasheet_by_name_and_unknown_devices_get_none():
    from bench import hardware as hw
    assert hw.spec_for("NVIDIA H200").hbm_tbs == 4.8 and hw.spec_for("NVIDIA H200").bf16_tflops == 989.4
    h100 = hw.spec_for("NVIDIA H100 80GB HBM3")
    assert h100.name == "H100 SXM" and h100.hbm_tbs == 3.35 and h100.bf16_tflops == 989.4
    assert "datasheet" in h100.source
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB", ""):
        assert hw.spec_for(other) is None
    with pytest.raises(ValueError, match="no datasheet figures for device 'NVIDIA A10G'"):
        hw.require_spec("NVIDIA A10G")
    assert hw.local_spec("cpu") is hw.CPU_DRY_RUN and hw.mfu(247.35, hw.SPECS["H200"]) == pytest.approx(0.25)
    assert hw.mfu(100.0, None) is None


def test_the_workload_floor_reads_each_live_sequences_context_once_a_step():
    """Two sequences (prompt 2 and 3, outputs 2 and 1), one slot at a time, 1 byte of weights, 10 of KV a token:
    steps read (1 + 20), (1 + 30) then (1 + 30 + ... ) as the slots free; prefill at the peak."""
    from bench import hardware as hw
    spec = hw.DeviceSpec("x", 1e-12, 1e-12, "test")   # 1 FLOP/s, 1 byte/s
    assert hw.workload_floor_s(1, 10, [2, 3], [2, 1], 1, 0.0, spec) == (1 + 20) + (1 + 30) + (1 + 30)
    assert hw.workload_floor_s(1, 10, [2, 3], [2, 1], 2, 5.0, spec) == (1 + 50) + (1 + 30) + 5.0


def test_old_results_files_are_recomputed_against_the_datasheet():
    """The raw files of the H100 and H200 campaigns, their stored MFU divided by a matmul rate measured in each
    process: against 989.4 TFLOP/s and the spec bandwidth the rows give what the hardware allows."""
    import bench.gpu_report as gpu_report
    h200 = json.loads((ROOT / "bench" / "results" / "h200-2026-11-27.json").read_text())
    rows = "\n".join(gpu_report.rows(h200))
    assert "| 0.251 (248 TFLOP/s" in rows and "| 0.36 (14947 tok/s" in rows and "| 0.47 (2265 GB/s" in rows
    assert "~0.059 (~58 TFLOP/s, 18.99 s" in rows and "12.1x" not in rows
    h100 = json.loads((ROOT / "bench" / "results" / "h100-2026-11-24.json").read_text())
    assert "| 0.257 (255 TFLOP/s" in "\n".join(gpu_report.rows(h100))


def test_part_2_runs_vs_vllm_or_names_the_missing_script(monkeypatch, tmp_path, capsys):
    import bench.gpu as gpu
    monkeypatch.setattr(gpu, "VS_VLLM", tmp_path / "bench" / "vs_vllm.py")
    monkeypatch.setattr(gpu, "ROOT", tmp_path)
    assert gpu.main(["--part", "2", "--out", "x.json"]) == 2
    assert "bench/vs_vllm.py is not in this tree" in capsys.readouterr().err
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "vs_vllm.py").write_text("import sys; sys.exit(0 if sys.argv[1:] == ['--out', 'x.json'] "
                                                    "else 3)\n")
    assert gpu.main(["--part", "2", "--out", "x.json"]) == 0


def test_a_saved_merged_campaign_becomes_the_simulators_profile_for_its_device(tmp_path):
    """`--report A B --save F` writes the merged file; every campaign file with the engine, grpo_step and e2e
    sections gives a measured profile named after its device (the newest of a device the plain name, each file a
    dated one), read from its own figures; files without those sections, or not a campaign, are skipped."""
    import bench.gpu as gpu
    from sim.profiles import QWEN3_0P6B, campaign_profiles, device_tag, h100_measured
    h100 = json.loads((ROOT / "bench" / "results" / "h100-2026-11-24.json").read_text())
    part_a = {"meta": dict(h100["meta"], device="NVIDIA H200", date="2026-12-01 10:00 UTC", command="p1"),
              "sections": {k: h100["sections"][k] for k in ("engine",)}}
    part_b = {"meta": dict(part_a["meta"], command="p3"),
              "sections": {k: h100["sections"][k] for k in ("grpo_step", "e2e")}}
    part_a["sections"]["engine"] = json.loads(json.dumps(part_a["sections"]["engine"]))
    part_a["sections"]["engine"]["results"]["decode_gbs"] = 3000.0
    (tmp_path / "a.json").write_text(json.dumps(part_a))
    (tmp_path / "b.json").write_text(json.dumps(part_b))
    out = tmp_path / "results"
    assert gpu.main(["--report", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                     "--save", str(out / "h200-2026-12-01.json")]) == 0
    merged = json.loads((out / "h200-2026-12-01.json").read_text())
    assert set(merged["sections"]) == {"engine", "grpo_step", "e2e"} and merged["meta"]["command"] == "p1 + p3"
    (out / "h100-2026-11-24.json").write_text(json.dumps(h100))
    (out / "engine-only.json").write_text(json.dumps(part_a))       # one section's raw output: no profile
    (out / "notes.json").write_text("[1, 2]")                         # not a campaign
    older = dict(part_a, meta=dict(part_a["meta"], date="2026-11-30 09:00 UTC"))
    older["sections"] = dict(merged["sections"])
    (out / "h200-2026-11-30.json").write_text(json.dumps(older))
    got = {p.name: p for p in campaign_profiles(out)}
    assert set(got) == {"h100_qwen3_0p6b", "h100_qwen3_0p6b_2026-11-24", "h200_qwen3_0p6b",
                        "h200_qwen3_0p6b_2026-11-30", "h200_qwen3_0p6b_2026-12-01"}
    assert got["h200_qwen3_0p6b"].k1 == pytest.approx(QWEN3_0P6B.kv_bytes_per_token / 3000e9)
    assert "h200-2026-12-01.json" in got["h200_qwen3_0p6b"].sources["k1"]        # the newest file of the device
    assert got["h100_qwen3_0p6b"] == h100_measured()
    assert device_tag("NVIDIA H100 80GB HBM3") == "h100" and device_tag("NVIDIA H200") == "h200"


def test_the_commit_the_caller_names_wins_over_the_copys_git(monkeypatch):
    """A device machine's copy of the work tree carried the session's first commit's .git (2026-11-27): results
    must record the commit that was sent, which the caller names in TIDAL_COMMIT."""
    import bench.gpu as gpu
    monkeypatch.setenv("TIDAL_COMMIT", "abc1234")
    assert gpu.meta(dry=True)["commit"] == "abc1234"
    monkeypatch.delenv("TIDAL_COMMIT")
    assert gpu.meta(dry=True)["commit"] != "abc1234"


def test_a_results_files_commit_says_when_the_tree_differs_from_it(tmp_path):
    """Without TIDAL_COMMIT the results name git's HEAD, marked +dirty where tracked files differ from it (a stale
    .git under newer files), and "unknown" outside a repository."""
    import bench.gpu as gpu

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    assert gpu.git_commit(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git("add", "f.py")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c")
    head = gpu.git_commit(tmp_path)
    assert head and "+" not in head and head != "unknown"
    (tmp_path / "new.py").write_text("untracked files are not the commit's: not dirty\n")
    assert gpu.git_commit(tmp_path) == head
    (tmp_path / "f.py").write_text("a = 2\n")
    assert gpu.git_commit(tmp_path) == head + "+dirty"


def test_train_bench_reports_each_modes_median_run_with_the_range(capsys):
    """`bench/train.py --repeats N` alternates the modes N times (a fresh trainer each): a mode's figure is its
    median run (the lower middle of an even count), every run's step time and the TFLOP/s range beside it; the
    campaign's row shows MFU against the datasheet's peak, the range, and the measured matmul only as an extra. No
    runs is a usage error."""
    import bench.gpu_report as gpu_report
    from bench import train as bt
    runs = [dict(step_s=2.0, tflops=300.0), dict(step_s=1.8, tflops=330.0), dict(step_s=2.4, tflops=250.0)]
    r = bt.median_run(runs)
    assert r["step_s"] == 2.0 and r["runs_step_s"] == [2.0, 1.8, 2.4] and r["tflops_range"] == [250.0, 330.0]
    assert bt.median_run(runs[:2])["step_s"] == 1.8
    with pytest.raises(SystemExit):
        bt.parse_args(["--repeats", "0"])
    assert "--repeats must be at least 1" in capsys.readouterr().err
    mode = dict(checkpointing=False, tflops=337.0, step_s=2.2, runs_step_s=[2.36, 2.20], tflops_range=[320.0, 337.0])
    results = {"meta": {"date": "d", "device": "NVIDIA H200", "torch": "t", "transformers": "x", "triton": "y",
                        "commit": "c", "command": "cmd", "campaign_s": 1.0, "dry_run": False},
               "sections": {"train": {"status": "ok", "results": {"runs": [
                   {"shape": "qwen3-1.7b", "micro_batch_tokens": 8192, "matmul_tflops": 728.0, "modes": [mode]}]}}}}
    row = next(r for r in gpu_report.rows(results) if r.startswith("| trainer, "))
    assert "| 0.341 (337 TFLOP/s, 2.200 s/step, runs 320-337 TFLOP/s; 0.463 of the 728 TFLOP/s" in row
    assert row.endswith("| **no** |")   # the target is 0.40 against the peak
    # the eager modules' run beside the fused one: a ratio row
    eager = dict(mode, fused_kernels=False, tflops=260.0, step_s=2.9)
    results["sections"]["train"]["results"]["runs"][0]["modes"] = [dict(mode, fused_kernels=True), eager]
    rows = gpu_report.rows(results)
    assert "1.32x (2.900 vs 2.200 s/step" in next(r for r in rows if "eager modules" in r)
    res = {"modes": [dict(checkpointing=False, fused_kernels=True, mfu=0.41, tflops=405.0, step_s=2.0),
                     dict(checkpointing=True, fused_kernels=True, mfu=0.33, tflops=326.0, step_s=2.5),
                     dict(checkpointing=False, fused_kernels=False, mfu=None, tflops=300.0, step_s=2.6)]}
    assert bt.headline(res) == ("trainer_mfu: 0.410 at 405 TFLOP/s (checkpointing off), 0.330 at 326 TFLOP/s "
                                "(checkpointing on); fused kernels vs eager 1.30x (checkpointing off)")
    assert bt.headline({"modes": res["modes"][2:]}) == ("trainer_mfu: - (device not in bench/hardware.py) at 300 "
                                                        "TFLOP/s (checkpointing off, eager modules)")
    with pytest.raises(SystemExit):
        bt.parse_args(["--eager", "of"])


def test_train_bench_profiles_one_step_of_each_mode(tmp_path):
    """`bench/train.py --profile PREFIX`: one untimed step of each mode under torch.profiler, a table per mode."""
    proc = subprocess.run([sys.executable, "bench/train.py", "--shape", "tiny", "--steps", "1", "--seqs", "2",
                           "--prompt", "8", "--response", "8", "--checkpointing", "off", "--eager", "off", "--profile",
                           str(tmp_path / "p")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("trainer_mfu: ")
    fused, eager = (tmp_path / "p.off-fused.txt").read_text(), (tmp_path / "p.off-eager.txt").read_text()
    assert "aten::mm" in fused and "=== by CPU time" in fused
    from cpu import ops as cpu_train
    if cpu_train.available():   # the C kernels are the CPU's fused path: their autograd op only in the fused mode
        assert "RMSNormBackward" in fused and "RMSNormBackward" not in eager


def test_train_bench_frees_each_modes_trainer_before_the_next():
    """On an H200 one bench/train.py process ran out of memory at its ninth run: every earlier mode's trainer (FSDP2's
    modules hold reference cycles) was still alive. With automatic collection off, none may survive its mode."""
    script = ("import gc; gc.disable()\n"
              "import cpu; cpu.enable()\n"
              "from bench import train as bt\n"
              "from trainer.trainer import Trainer\n"
              "bt.init_one_rank('cpu')\n"
              "args = bt.parse_args(['--shape', 'tiny', '--steps', '1', '--seqs', '2', '--prompt', '8',\n"
              "                      '--response', '8'])\n"
              "bt.bench_mode(args, bt.shape('tiny'), False, 1e9)\n"
              "print('alive', sum(isinstance(o, Trainer) for o in gc.get_objects()))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "alive 0"


def test_a_profiles_device_time_counts_each_kernel_once():
    """The op rows (aten::mm) carry their kernels' device time and the kernel rows carry it again: the device's busy
    time is the device rows' sum, the table footer's "Self CUDA time total", not every row's."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from bench.train import device_self_us
    rows = [SimpleNamespace(device_type=DeviceType.CPU, self_device_time_total=1863.0),    # aten::mm
            SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=1200.0),   # its GEMM kernels
            SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=663.0),
            SimpleNamespace(device_type=DeviceType.CPU, self_device_time_total=0.0)]       # host-only op
    assert device_self_us(rows) == 1863.0


def test_a_saved_profiles_device_time_is_read_from_its_tables_footer():
    from bench.gpu_report import profile_device_s
    table = "| aten::mm | ... |\nSelf CPU time total: 6.435s\nSelf CUDA time total: 412.5ms\n"
    assert profile_device_s({"device_s": 8.86, "table": table}) == pytest.approx(0.4125)
    assert profile_device_s({"device_s": 1.5, "table": "no footer"}) == 1.5


def test_a_compiled_mode_that_fails_is_its_own_row_and_the_fused_figures_stand():
    """The compiled trainer (train.compile) never ran on a GPU: if it fails there, bench/train.py records the error
    as that mode's result and goes on, so the campaign's train section keeps its fused figures; the report names the
    failure."""
    import bench.gpu_report as gpu_report
    script = ("import cpu; cpu.enable()\n"
              "import json, trainer.trainer as tt\n"
              "from bench import train as bt\n"
              "def broken(model): raise RuntimeError('inductor said no')\n"
              "tt.compile_blocks = broken\n"
              "args = bt.parse_args(['--shape', 'tiny', '--steps', '1', '--seqs', '2', '--prompt', '8',\n"
              "                      '--response', '8', '--checkpointing', 'off', '--compiled', 'off'])\n"
              "res = bt.run(args)\n"
              "print(bt.headline(res))\n"
              "print(json.dumps(res))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    headline, res = proc.stdout.strip().splitlines()[-2], json.loads(proc.stdout.strip().splitlines()[-1])
    fused, compiled = res["modes"]
    assert fused["fused_kernels"] and fused["tflops"] > 0 and "error" not in fused
    assert compiled["compiled"] and compiled["error"] == "RuntimeError: inductor said no"
    assert headline.startswith("trainer_mfu: ") and "compiled" not in headline
    results = {"meta": {"date": "d", "device": "NVIDIA H200", "torch": "t", "transformers": "x", "triton": "y",
                        "commit": "c", "command": "cmd", "campaign_s": 1.0, "dry_run": False},
               "sections": {"train": {"status": "ok", "results": {"runs": [res]}}}}
    rows = [r for r in gpu_report.rows(results) if r.startswith("| trainer, ")]
    assert len(rows) == 2 and rows[1].endswith("| failed: RuntimeError: inductor said no | >= 0.40 | **no** |")

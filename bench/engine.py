"""Decode throughput: our engine vs transformers on the same random model and workload, in one run.

    python bench/engine.py                  # CPU: small Qwen3-shaped model, 64 prompts, lengths in [32, 256]
    python bench/engine.py --device cuda    # GPU: Qwen3-0.6B-shaped model (bf16), 256 prompts, lengths in [100, 1024]

Workload: random prompt token ids and output lengths, each uniform in [min, max]; EOS is ignored, so every request
generates exactly its output length. Throughput counts those requested output tokens over wall time.
Peers: transformers `generate` with static batches of --hf-batch-size requests in arrival order (left padded; a batch
runs until its longest request is done) and, where installed, `generate_batch`-style continuous batching (the
ContinuousBatchingManager with per-request max_new_tokens). The ratio is against the faster peer.
On CUDA it also reports the fraction of the floor reached (bench/hardware.py): decode steps' (weight bytes + KV
bytes attended) over the spec HBM bandwidth, against their time; the whole run's floor (the same bytes of an ideal
schedule plus prefill FLOPs at the dense bf16 peak) against its time. A device-to-device copy bandwidth measured in the
same run is printed beside them, never as a denominator.
The last line is the headline, e.g. `engine_vs_hf_generate: 4.2x`.
"""
from __future__ import annotations

import argparse
import gc
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cpu  # noqa: E402
from engine import EngineConfig, GenRequest, LLMEngine, SamplingParams  # noqa: E402
from model import load_model  # noqa: E402

SHAPES = {  # Qwen3 family; "tiny" and "small" fit a 2-core box, "qwen3-0.6b" is the GPU workload's model
    "tiny": dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", choices=sorted(SHAPES), help="model shape (default: small on cpu, qwen3-0.6b on cuda)")
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--min-len", type=int, help="min prompt and output length")
    p.add_argument("--max-len", type=int, help="max prompt and output length")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--hf-batch-size", type=int, help="static batch size for transformers generate")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-hf-cb", action="store_true", help="skip transformers continuous batching")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phases", action="store_true", help="also print ms per engine step in each phase")
    p.add_argument("--unfused-baseline", action="store_true", help="also run our engine without its fused ops and "
                   "sampling kernel (alternating) and print the ratio")
    p.add_argument("--op-by-op-baseline", action="store_true", help="also run our engine with its forward op by "
                   "op instead of one C call (CPU, small models: cpu/forward.py)")
    p.add_argument("--hf-cb-deadline", type=float, default=600.0, help="seconds before continuous batching gives up")
    p.add_argument("--threads", type=int, help="torch CPU threads for both (default: torch's)")
    p.add_argument("--repeats", type=int, default=2, help="alternate engine and hf generate runs; keep each's best")
    a = p.parse_args(argv)
    cpu = a.device == "cpu"
    for k, cpu_v, gpu_v in [("shape", "small", "qwen3-0.6b"), ("num_prompts", 64, 256), ("min_len", 32, 100),
                            ("max_len", 256, 1024), ("max_num_seqs", 64, 256), ("hf_batch_size", 64, 256)]:
        if getattr(a, k) is None:
            setattr(a, k, cpu_v if cpu else gpu_v)
    return a


def make_models(device: str, shape: str, tmp: Path):
    """The same random weights as a transformers model and as ours."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    cfg = Qwen3Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device).eval()
    hf.save_pretrained(str(tmp))
    return hf, load_model(tmp, device=device)


def workload(n: int, lo: int, hi: int, vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [rng.randint(lo, hi) for _ in range(n)]


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_engine(model, prompts, outs, args, fused: bool = True, cpu_forward: bool = True, traffic=None):
    """(seconds, decode bytes per second, stats) of our engine on the workload; `fused=False`: without the fused
    model ops and sampling kernel (engine/fused.py, kernels/sample.py), the engine as it was before them;
    `cpu_forward=False`: a CPU engine's forward op by op instead of in one C call (cpu/forward.py); `traffic`: a
    bench/hardware.py Traffic that sums what the steps read (for the floor fractions)."""
    pool = None if args.device == "cuda" else args.max_num_seqs * 2 * args.max_len  # CPU: room for all at full length
    eng = LLMEngine(model, EngineConfig(max_num_seqs=args.max_num_seqs, max_batch_tokens=max(2048, args.max_num_seqs),
                                        num_kv_tokens=pool, memory_fraction=0.5, fused_ops=fused,
                                        fused_sampling=fused, cpu_forward=cpu_forward,
                                        cpu_decode_steps=16))   # a CPU engine: up to 16 decode steps a C call
    eng.generate([GenRequest(p[:16], SamplingParams(temperature=0, max_new_tokens=4)) for p in prompts[:4]])  # warm-up
    reqs = [GenRequest(p, SamplingParams(temperature=1.0, max_new_tokens=o, ignore_eos=True, seed=i))
            for i, (p, o) in enumerate(zip(prompts, outs))]
    decode_bytes = decode_time = 0.0
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * eng.runner.dtype.itemsize
    sync(args.device)
    t0 = time.perf_counter()
    ids = {eng.add_request(r) for r in reqs}
    got = 0
    while eng.has_unfinished():
        got += sum(len(o.token_ids) for o in eng.step() if o.request_id in ids)
        s = eng.last_step
        read = weight_bytes * s.steps + s.context_tokens * kv_per_token
        if s.num_decode == s.num_seqs:
            decode_bytes += read
            decode_time += s.seconds
        if traffic is not None and s.num_seqs:
            traffic.run_bytes += read
            traffic.steps += 1
            if s.num_decode == s.num_seqs:
                traffic.decode_bytes += read
                traffic.decode_s += s.seconds
                traffic.decode_steps += 1
    sync(args.device)
    secs = time.perf_counter() - t0
    assert got == sum(outs), (got, sum(outs))
    snap = eng.stats()
    del eng
    if args.device == "cuda":  # hand the KV pool back before transformers needs the memory
        gc.collect()
        torch.cuda.empty_cache()
    return secs, decode_bytes / decode_time if decode_time else 0.0, snap


def run_hf_generate(hf, prompts, outs, args, deadline_s: float = float("inf")):
    """transformers' static `generate` in batches of args.hf_batch_size (arrival order, each batch padded to its
    longest prompt and run to its longest output). A batch that would end past `deadline_s` (judged from the mean
    of those before it) is not started: `Unfinished` then names how many requests were done, a lower bound on its
    time."""
    dev = args.device
    hf.generate(torch.tensor([prompts[0][:8]], device=dev), max_new_tokens=4, do_sample=False, pad_token_id=0)
    sync(dev)
    t0 = time.perf_counter()
    for s in range(0, len(prompts), args.hf_batch_size):
        spent = time.perf_counter() - t0
        if s and spent + spent / (s // args.hf_batch_size) > deadline_s:
            raise Unfinished(s, len(prompts), spent, "transformers static generate")
        ps, n = prompts[s:s + args.hf_batch_size], max(outs[s:s + args.hf_batch_size])
        width = max(map(len, ps))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=dev)
        hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=True, top_k=0,
                    pad_token_id=0)
    sync(dev)
    return time.perf_counter() - t0


class Unfinished(TimeoutError):
    """A transformers peer (continuous batching, or static `generate`) stopped at its deadline, having finished
    `done` of `total` requests: its time is at least `secs`, so our engine's speed-up over it is at least `secs` /
    ours."""
    def __init__(self, done: int, total: int, secs: float, peer: str = "transformers continuous batching"):
        super().__init__(f"{peer} finished {done} of {total} requests in {secs:.0f} s")
        self.done, self.total, self.secs = done, total, secs


class _Errors(logging.Handler):
    """ERROR records of a logger, kept: transformers' continuous batching reports a failed step only in its log."""
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def cpu_cache_size(prompts, outs, device: str) -> dict:
    """On CPU, transformers sizes its paged cache from the host's free memory (14 GB on a 24 GB machine, 15 s just
    to zero it): size it to the workload instead, as our engine's `num_kv_tokens` is on CPU. On a GPU both engines
    size their KV pool from free device memory, so nothing is passed there."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:  # an older release: its own default
        return {}
    if device != "cpu":
        return {}
    page = 256
    blocks = sum(-(-(len(p) + o) // page) for p, o in zip(prompts, outs))
    return {"continuous_batching_config": ContinuousBatchingConfig(page_size=page, num_blocks=blocks,
                                                                    max_batch_tokens=2048)}


def run_hf_continuous(hf, prompts, outs, args, deadline_s: float = 600.0, stall_s: float = 15.0):
    """transformers' continuous batching (what generate_batch runs), with each request's own max_new_tokens.
    Raises RuntimeError with transformers' logged error when one is followed by `stall_s` without a result (its
    generation thread can live on without making progress; some logged errors are harmless), and TimeoutError
    naming how far it got (`Unfinished`: a lower bound on its time) when not done within `deadline_s`."""
    from transformers import GenerationConfig
    if not hasattr(hf, "continuous_batching_context_manager"):
        return None
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(outs))
    errors, log = _Errors(), logging.getLogger("ContinuousBatchingLogger")
    log.addHandler(errors)
    try:
        with hf.continuous_batching_context_manager(generation_config=gen, block=True, timeout=5,
                                                    **cpu_cache_size(prompts, outs, args.device)) as manager:
            sync(args.device)
            t0 = time.perf_counter()
            for i, (p, o) in enumerate(zip(prompts, outs)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=o)
            done, deadline = 0, time.perf_counter() + deadline_s
            last = time.perf_counter()
            while done < len(prompts):
                if errors.messages and time.perf_counter() - last > stall_s:
                    raise RuntimeError(f"transformers continuous batching failed after {done} of {len(prompts)} "
                                       f"requests: {errors.messages[0]}")
                if time.perf_counter() > deadline:
                    raise Unfinished(done, len(prompts), time.perf_counter() - t0)
                r = manager.get_result(timeout=1)
                if r is not None:
                    last = time.perf_counter()
                if r is not None and r.is_finished():
                    done += 1
                elif r is None and not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped early")
            sync(args.device)
            secs = time.perf_counter() - t0
    finally:
        log.removeHandler(errors)
    return secs


def engine_phases(model, prompts, outs, args, steps: int = 60) -> dict[str, float]:
    """Milliseconds per engine step in each phase (schedule, runner = batch tensors + forward, sample, postprocess),
    over `steps` decode steps after the prompts' prefill (whose mixed steps are timed apart: prefill_step), with a
    device sync closing the runner and sampler phases so each phase's device work is charged to it. Where the time
    of a decode step goes, beside its roofline."""
    eng = LLMEngine(model, EngineConfig(max_num_seqs=args.max_num_seqs, max_batch_tokens=max(2048, args.max_num_seqs),
                                        memory_fraction=0.5, num_kv_tokens=None if args.device == "cuda" else
                                        args.max_num_seqs * 2 * args.max_len))
    spent: dict[str, float] = {"schedule": 0.0, "runner": 0.0, "sample": 0.0, "postprocess": 0.0}

    def timed(name, fn, synced):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if synced:
                sync(args.device)
            spent[name] += time.perf_counter() - t0
            return out
        return wrapper
    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule, False)
    eng.runner.run = timed("runner", eng.runner.run, True)
    eng.sampler = timed("sample", eng.sampler, True)
    eng.scheduler.postprocess = timed("postprocess", eng.scheduler.postprocess, False)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        eng.add_request(GenRequest(p, SamplingParams(temperature=1.0, max_new_tokens=o, ignore_eos=True, seed=i)))
    prefill_s = prefill_steps = 0
    while eng.has_unfinished():  # the prompts' prefill chunks (mixed steps), timed apart from the decode steps
        eng.step()
        if eng.last_step.num_decode == eng.last_step.num_seqs:
            break
        prefill_s, prefill_steps = prefill_s + eng.last_step.seconds, prefill_steps + 1
    for k in spent:
        spent[k] = 0.0
    total, decode_steps, batch = 0.0, 0, 0
    for _ in range(steps):
        eng.step()
        total += eng.last_step.seconds
        decode_steps += eng.last_step.num_decode == eng.last_step.num_seqs
        batch += eng.last_step.num_seqs
    out = {k: 1e3 * v / steps for k, v in spent.items()}
    out.update(step=1e3 * total / steps, other=1e3 * total / steps - sum(out.values()), mean_batch=batch / steps,
               decode_share=decode_steps / steps, prefill_step=1e3 * prefill_s / max(prefill_steps, 1),
               prefill_steps=prefill_steps)
    del eng
    if args.device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    return out


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * 10 * x.numel() / (time.perf_counter() - t0)


def main(argv=None):
    args = parse_args(argv)
    cpu.enable()   # the C backend for CPU engines (cpu/)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/engine.py: --device cuda but CUDA is not available")
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = make_models(args.device, args.shape, Path(tmp))
    prompts, outs = workload(args.num_prompts, args.min_len, args.max_len, SHAPES[args.shape]["vocab_size"] - 1,
                             args.seed)
    total = sum(outs)
    print(f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {total} output tokens, "
          f"lengths in [{args.min_len}, {args.max_len}], model {args.shape}, device {args.device}, "
          f"{torch.get_num_threads()} threads, {args.max_num_seqs} sequences at a time")
    secs, hf_secs, base_s, ops_s = float("inf"), float("inf"), float("inf"), float("inf")
    for _ in range(args.repeats):  # alternating, best of each: shared machines are noisy
        with torch.inference_mode():
            if args.unfused_baseline:
                base_s = min(base_s, run_engine(ours, prompts, outs, args, fused=False)[0])
            if args.op_by_op_baseline:
                ops_s = min(ops_s, run_engine(ours, prompts, outs, args, cpu_forward=False)[0])
            s, bw_, snap_ = run_engine(ours, prompts, outs, args)
            if s < secs:
                secs, decode_bw, snap = s, bw_, snap_
            if not args.skip_hf:
                hf_secs = min(hf_secs, run_hf_generate(hf, prompts, outs, args))
    ours_tps = total / secs
    if args.unfused_baseline:
        print(f"engine without fused ops and sampling kernel: {total / base_s:.1f} tok/s ({base_s:.2f} s)")
    if args.op_by_op_baseline:
        print(f"engine with its forward op by op: {total / ops_s:.1f} tok/s ({ops_s:.2f} s)")
    print(f"engine: {ours_tps:.1f} tok/s ({secs:.2f} s, {snap.num_steps} steps, {snap.num_preemptions} preemptions)")
    if args.device == "cuda":
        from bench.hardware import engine_workload_floor, local_spec
        bw, spec = copy_bandwidth("cuda"), local_spec("cuda")
        floor = ""
        if spec is not None:
            run_floor = engine_workload_floor(SHAPES[args.shape], args.num_prompts, args.min_len, args.max_len,
                                              args.seed, args.max_num_seqs, spec)
            floor = (f", {decode_bw / spec.hbm_bytes_s:.2f} of the spec {spec.hbm_tbs} TB/s; whole run "
                     f"{run_floor / secs:.2f} of the floor")
        print(f"engine decode: {decode_bw / 1e9:.0f} GB/s of weights + KV read (copy bandwidth {bw / 1e9:.0f} GB/s)"
              + floor)
    if args.phases:
        with torch.inference_mode():
            ph = engine_phases(ours, prompts, outs, args)
        print("engine step phases (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()))
    del ours
    if args.unfused_baseline:  # the last line(s) when transformers is skipped
        print(f"engine_vs_unfused: {base_s / secs:.2f}x")
    if args.op_by_op_baseline:
        print(f"engine_vs_op_by_op: {ops_s / secs:.2f}x")
    if args.skip_hf:
        return
    peers = {"hf_generate": hf_secs}
    print(f"hf generate (static batches of {args.hf_batch_size}): {total / hf_secs:.1f} tok/s ({hf_secs:.2f} s)")
    if not args.skip_hf_cb:
        try:
            cb = run_hf_continuous(hf, prompts, outs, args, args.hf_cb_deadline)
        except Unfinished as e:
            cb = None
            print(f"hf continuous batching: {e}; engine_vs_hf_continuous_batching: at least {e.secs / secs:.1f}x")
        if cb is not None:
            peers["hf_continuous_batching"] = cb
            print(f"hf continuous batching: {total / cb:.1f} tok/s ({cb:.2f} s)")
    best = min(peers, key=peers.get)
    print(f"engine_vs_{best.replace('hf_continuous_batching', 'hf_generate_batch')}: "
          f"{ours_tps / (total / peers[best]):.1f}x")


if __name__ == "__main__":
    main()

"""Our engine and vLLM in one process on the same random-weight Qwen3-0.6B directory and nano-vllm's workload.

    PYTHONPATH=/tmp/vllm_site python3 bench/vs_vllm.py --out bench/results/vs_vllm.json   # GPU (vLLM carried in:
                                                                                           # bench/carry_vllm.py)
    python bench/vs_vllm.py --dry-run                                                      # CPU: tiny sizes

Workload (nano-vllm's bench.py): 256 sequences, prompt and output lengths uniform in [100, 1024] (seeded), random
token-id prompts, EOS ignored, so each request generates exactly its output length; temperature sampling, no
per-request seeds on either side (vLLM's seeded requests take its slower sampling path). One directory
(config.json with Qwen3ForCausalLM + model.safetensors, bench/engine.make_models) feeds both.
vLLM at its defaults (CUDA graphs, torch.compile, FlashAttention 3 on Hopper) with
`LLM(skip_tokenizer_init=True, gpu_memory_utilization=0.4, max_num_seqs=256, enable_prefix_caching=False,
max_num_batched_tokens=16384)` (its default here); ours with max_num_seqs 256, the same 16384 tokens a step
(--max-batch-tokens sets both) and a KV pool that holds the whole workload (--kv-gib). The two alternate
(--repeats), each keeping its best wall time; vLLM's LLM is built once, before its first timed run, and warmed up.

Each side's wall time, output tokens/s and fraction of the floor (`floor_seconds`: weight + KV bytes read by decode
over the spec HBM bandwidth plus prefill FLOPs over the dense bf16 peak, for this workload, the same for both), then
the last line `ours / vLLM throughput: X.XXx`. --out writes it all as JSON. --dry-run runs our side at tiny sizes on
the CPU and vLLM's plumbing up to its import (skipped with a message when vllm is not importable; on the CPU, the
LLM is never built).
"""
from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import SHAPES, make_models, workload
from engine import EngineConfig, GenRequest, LLMEngine, SamplingParams

# Spec sheets (bytes/s, dense bf16 FLOP/s without sparsity): NVIDIA H100 SXM and H200 datasheets.
SPECS = {"H200": (4.8e12, 989.4e12), "H100": (3.35e12, 989.4e12)}


@dataclass(frozen=True)
class Shape:
    """A Qwen3-style decoder: what the floor needs to count bytes and FLOPs."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = True
    dtype_bytes: int = 2

    def linear_params(self) -> int:
        """Weights of the per-token matmuls in all layers (q, k, v, o projections and the SwiGLU MLP)."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return self.num_hidden_layers * (h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size)

    def weight_bytes(self) -> int:
        """Every parameter once (a tied embedding/LM head counted once): what one decode step reads at least."""
        norms = self.num_hidden_layers * (2 * self.hidden_size + 2 * self.head_dim) + self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return (self.linear_params() + norms + embed) * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * self.dtype_bytes


def decode_steps(outs: list[int], max_num_seqs: int) -> int:
    """Decode steps when at most max_num_seqs sequences decode at once, each slot taken by the next sequence in
    arrival order the moment one finishes; a sequence of o output tokens needs o - 1 of them (prefill gives its
    first)."""
    slots = [0] * min(max_num_seqs, len(outs))
    for o in outs:
        heapq.heappush(slots, heapq.heappop(slots) + max(o - 1, 0))
    return max(slots, default=0)


def floor_seconds(shape: Shape, prompts: list[int], outs: list[int], max_num_seqs: int, hbm_bytes_s: float,
                  peak_flops: float) -> dict[str, float]:
    """The least time any engine can take on this workload on a device with these spec rates.

    decode: each decode step reads every weight once (`decode_steps`), and the n-th decode step of a sequence with
    prompt length p attends to p + n cached tokens (n = 1 .. o - 1), K and V in every layer; over hbm_bytes_s.
    prefill: 2 FLOPs per linear weight per prompt token, causal attention (QK^T and PV: 4 * head_dim FLOPs per
    query-key pair per head per layer, p (p + 1) / 2 pairs) and the LM head for the last prompt token; over
    peak_flops. Returns decode_s, prefill_s and their sum total_s (plus the bytes and FLOPs counted)."""
    s = shape
    kv_tokens = sum((o - 1) * p + (o - 1) * o // 2 for p, o in zip(prompts, outs) if o > 1)
    decode_bytes = decode_steps(outs, max_num_seqs) * s.weight_bytes() + kv_tokens * s.kv_bytes_per_token()
    pairs = sum(p * (p + 1) // 2 for p in prompts)
    prefill_flops = (2 * s.linear_params() * sum(prompts)
                     + 4 * s.head_dim * s.num_attention_heads * s.num_hidden_layers * pairs
                     + 2 * s.vocab_size * s.hidden_size * len(prompts))
    d, p = decode_bytes / hbm_bytes_s, prefill_flops / peak_flops
    return {"decode_s": d, "prefill_s": p, "total_s": d + p, "decode_bytes": decode_bytes,
            "prefill_flops": prefill_flops}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: our side, and vLLM's up to its import")
    p.add_argument("--num-seqs", type=int, help="default 256 (dry run 8)")
    p.add_argument("--min-len", type=int, help="default 100 (dry run 8)")
    p.add_argument("--max-len", type=int, help="default 1024 (dry run 32)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.6, help="nano-vllm's bench samples at 0.6")
    p.add_argument("--seed", type=int, default=0, help="the workload's lengths and prompts")
    p.add_argument("--repeats", type=int, default=2, help="alternate ours and vLLM this many times; best of each")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vLLM's")
    p.add_argument("--max-batch-tokens", type=int, default=16384,
                   help="tokens per step on both sides (ours max_batch_tokens, vLLM's max_num_batched_tokens)")
    p.add_argument("--kv-gib", type=float, default=40.0, help="our KV pool on the GPU (the workload needs ~31 GiB)")
    p.add_argument("--spec", choices=sorted(SPECS), default="H200", help="spec rates for the floor")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    a = p.parse_args(argv)
    for k, full, dry in [("num_seqs", 256, 8), ("min_len", 100, 8), ("max_len", 1024, 32)]:
        if getattr(a, k) is None:
            setattr(a, k, dry if a.dry_run else full)
    if not 1 <= a.min_len <= a.max_len:
        p.error(f"need 1 <= --min-len ({a.min_len}) <= --max-len ({a.max_len})")
    a.device = "cpu" if a.dry_run else "cuda"
    a.shape = "tiny" if a.dry_run else "qwen3-0.6b"
    return a


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_tokens(args: argparse.Namespace) -> int:
    """Tokens computed per engine step (decodes + prefill chunks), the same number on both sides."""
    return max(args.max_batch_tokens, args.max_num_seqs)


def run_ours(model, prompts, outs, args) -> dict:
    """Wall seconds of our engine on the workload (engine built and warmed up outside the timing), and its steps."""
    cuda = args.device == "cuda"
    room = 2 * len(prompts) * 2 * args.max_len          # CPU: every sequence at full length, twice over
    pool = {"kv_cache_bytes": int(args.kv_gib * 2**30)} if cuda else {"num_kv_tokens": room}
    eng_tokens = step_tokens(args)
    eng = LLMEngine(model, EngineConfig(max_num_seqs=args.max_num_seqs, max_batch_tokens=eng_tokens, **pool))
    eng.generate([GenRequest(p[:16], SamplingParams(temperature=0, max_new_tokens=4)) for p in prompts[:4]])
    reqs = [GenRequest(p, SamplingParams(temperature=args.temperature, max_new_tokens=o, ignore_eos=True))
            for p, o in zip(prompts, outs)]
    sync(args.device)
    t0 = time.perf_counter()
    done = eng.generate(reqs)
    sync(args.device)
    secs = time.perf_counter() - t0
    got = sum(len(o.token_ids) for o in done)
    if got != sum(outs):
        raise RuntimeError(f"our engine generated {got} tokens, the workload asks {sum(outs)}")
    snap = eng.stats()
    del eng, done
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"seconds": secs, "tokens": got, "steps": snap.num_steps, "preemptions": snap.num_preemptions,
            "max_batch_tokens": eng_tokens}


def vllm_plan(model_dir: str, prompts, outs, args) -> tuple[dict, list[dict], list[dict]]:
    """vLLM's LLM(...) arguments, its token-id prompts (TokensPrompt's keys) and SamplingParams' arguments."""
    llm_kwargs = {"model": model_dir, "skip_tokenizer_init": True,
                  "gpu_memory_utilization": args.gpu_memory_utilization, "max_num_seqs": args.max_num_seqs,
                  "enable_prefix_caching": False, "max_num_batched_tokens": step_tokens(args)}
    return (llm_kwargs, [{"prompt_token_ids": p} for p in prompts],
            [{"temperature": args.temperature, "ignore_eos": True, "max_tokens": o} for o in outs])


def import_vllm():
    """vllm's module, or the one-line reason it cannot be imported."""
    try:
        import vllm
        return vllm, None
    except Exception as e:  # noqa: BLE001 - any failure of a carried install is reported, not raised
        return None, f"{type(e).__name__}: {e}".splitlines()[0]


def vllm_requests(vllm, token_prompts: list[dict], params: list[dict]) -> tuple[list, list]:
    """vLLM's TokensPrompt and SamplingParams objects for the plan (built in a dry run too: checks the arguments)."""
    from vllm.inputs import TokensPrompt
    return [TokensPrompt(**p) for p in token_prompts], [vllm.SamplingParams(**k) for k in params]


class VllmSide:
    """vLLM's LLM on the model directory, built once (warm-up included) and timed per run."""

    def __init__(self, vllm, model_dir: str, prompts, outs, args) -> None:
        kwargs, tp, sp = vllm_plan(model_dir, prompts, outs, args)
        t0 = time.perf_counter()
        self.llm = vllm.LLM(**kwargs)
        warm, _ = vllm_requests(vllm, [{"prompt_token_ids": p["prompt_token_ids"][:16]} for p in tp[:4]], [])
        self.llm.generate(warm, vllm.SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        self.startup_s = time.perf_counter() - t0
        self.prompts, self.params = vllm_requests(vllm, tp, sp)
        self.total = sum(outs)

    def run(self) -> dict:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        secs = time.perf_counter() - t0
        got = sum(len(r.outputs[0].token_ids) for r in res)
        if got != self.total:
            raise RuntimeError(f"vLLM generated {got} tokens, the workload asks {self.total}")
        return {"seconds": secs, "tokens": got}


def summary(name: str, runs: list[dict], total: int, floor_s: float) -> dict:
    best = min(r["seconds"] for r in runs)
    return {"name": name, "seconds": best, "runs_s": [r["seconds"] for r in runs], "tok_s": total / best,
            "floor_fraction": floor_s / best, **{k: v for k, v in runs[0].items() if k not in ("seconds",)}}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench/vs_vllm.py: CUDA is not available (use --dry-run on a CPU)")
    if args.dry_run:
        import cpu
        cpu.enable()
    shape = Shape(**SHAPES[args.shape], dtype_bytes=4 if args.dry_run else 2)
    prompts, outs = workload(args.num_seqs, args.min_len, args.max_len, shape.vocab_size - 1, args.seed)
    total = sum(outs)
    bw, peak = SPECS[args.spec]
    floor = floor_seconds(shape, [len(p) for p in prompts], outs, args.max_num_seqs, bw, peak)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run; floor on the spec rates anyway)"
    print(f"workload: {len(prompts)} sequences, {sum(map(len, prompts))} prompt tokens, {total} output tokens, "
          f"lengths U[{args.min_len}, {args.max_len}], model {args.shape}, {dev}")
    print(f"floor ({args.spec}: {bw / 1e12:.1f} TB/s, {peak / 1e12:.1f} TFLOP/s): decode {floor['decode_s']:.3g} s + "
          f"prefill {floor['prefill_s']:.3g} s = {floor['total_s']:.3g} s")
    vllm, why = (None, "--skip-vllm") if args.skip_vllm else import_vllm()
    result = {"workload": {"num_seqs": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": total,
                           "min_len": args.min_len, "max_len": args.max_len, "seed": args.seed,
                           "temperature": args.temperature, "max_num_seqs": args.max_num_seqs},
              "model": asdict(shape), "device": dev, "spec": {"name": args.spec, "hbm_bytes_s": bw, "peak_flops": peak},
              "floor": floor, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = make_models(args.device, args.shape, Path(tmp))
        del hf
        plan = vllm_plan(tmp, prompts, outs, args)
        result["vllm_llm_kwargs"] = {k: v for k, v in plan[0].items() if k != "model"}
        side = None
        if vllm is None:
            print(f"vllm: not importable ({why}): skipped")
            result["vllm"] = {"skipped": why}
        elif args.dry_run:
            vp, vs = vllm_requests(vllm, plan[1], plan[2])
            assert sum(p.max_tokens for p in vs) == total and len(vp) == len(prompts)
            print(f"vllm {vllm.__version__}: imported, {len(vp)} TokensPrompt and SamplingParams built; LLM not built "
                  f"in a dry run")
            result["vllm"] = {"skipped": "dry run", "version": vllm.__version__}
        mine, theirs = [], []
        for _ in range(args.repeats):   # alternating: one process, the same GPU state for both
            with torch.inference_mode():
                mine.append(run_ours(ours, prompts, outs, args))
            print(f"ours: {mine[-1]['seconds']:.2f} s")
            if vllm is not None and not args.dry_run:
                if side is None:
                    side = VllmSide(vllm, tmp, prompts, outs, args)
                    print(f"vllm {vllm.__version__}: built and warmed up in {side.startup_s:.0f} s")
                theirs.append(side.run())
                print(f"vllm: {theirs[-1]['seconds']:.2f} s")
    result["ours"] = summary("ours", mine, total, floor["total_s"])
    o = result["ours"]
    print(f"ours: {o['seconds']:.2f} s, {o['tok_s']:.0f} output tok/s, {o['floor_fraction']:.3g} of the floor "
          f"({o['steps']} steps, {o['preemptions']} preemptions)")
    if theirs:
        result["vllm"] = {**summary("vllm", theirs, total, floor["total_s"]), "version": vllm.__version__,
                          "startup_s": side.startup_s,
                          "attention": os.environ.get("VLLM_ATTENTION_BACKEND", "default (FlashAttention 3 on Hopper)")}
        v = result["vllm"]
        print(f"vllm: {v['seconds']:.2f} s, {v['tok_s']:.0f} output tok/s, {v['floor_fraction']:.3g} of the floor")
        result["ours_over_vllm"] = o["tok_s"] / v["tok_s"]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if theirs:
        print(f"ours / vLLM throughput: {result['ours_over_vllm']:.2f}x")
    else:
        print("ours / vLLM throughput: n/a (no vLLM run)")
    return result


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

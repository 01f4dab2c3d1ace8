"""Standalone generation with our engine: prompts from a JSONL file in, sampled responses as JSONL out.

    python rollout.py --model DIR --prompts prompts.jsonl --out samples.jsonl \\
        [--tokenizer DIR --max-new-tokens 256 --temperature 1.0 --top-p 1.0 --top-k 0 --n 1 --seed 0 \\
         --prompt-field prompt]

Each input line is a JSON object whose `--prompt-field` holds text (tokenized with `--tokenizer`, by default the model
directory's own tokenizer, which a training run's RUN_DIR/hf carries; `--chat-template` wraps it as one user turn) or
a list of token ids. Each output line is one sample:
{"prompt_index", "sample_index", "token_ids", "text", "logprobs", "finish_reason"}. The n samples of a prompt form
one group, so the engine prefills the prompt once. Sample j of prompt i is seeded with seed + i * n + j.

Bad input (model directory, prompt file, parameters) is reported in one line on stderr with exit code 2. The output
is written to a temporary file beside --out and renamed into place when complete, so a run that fails or is
interrupted never leaves a partial --out behind (a previous complete one stays as it was).
Training runs do not use this file: the rollout partition's worker loop is runtime/rollout_worker.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import cpu
from engine import EngineConfig, GenRequest, LLMEngine, SamplingParams
from rl.jsonl import iter_jsonl


class UsageError(Exception):
    """Bad input from the command line; reported without a traceback, exit code 2."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollout.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory (config.json + *.safetensors)")
    p.add_argument("--prompts", required=True, help="JSONL file, one prompt per line")
    p.add_argument("--out", required=True, help="JSONL file to write, one sample per line")
    p.add_argument("--tokenizer", default=None,
                   help="Hugging Face tokenizer directory for text prompts (default: the model directory's)")
    p.add_argument("--prompt-field", default="prompt", help="field of each line holding the prompt")
    p.add_argument("--chat-template", action="store_true", help="render text prompts with the chat template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: checkpoint's")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-kv-tokens", type=int, default=None, help="KV pool size (default: from free memory)")
    args = p.parse_args(argv)
    checks = [(args.temperature >= 0, f"--temperature must be >= 0, got {args.temperature}"),
              (0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}"),
              (args.top_k >= 0, f"--top-k must be >= 0, got {args.top_k}"),
              (args.n >= 1, f"--n must be >= 1, got {args.n}"),
              (args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"),
              (args.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {args.max_num_seqs}"),
              (args.num_kv_tokens is None or args.num_kv_tokens >= 1,
               f"--num-kv-tokens must be >= 1, got {args.num_kv_tokens}"),
              (_device_ok(args.device), f"--device must be cpu, cuda or cuda:N, got {args.device!r}")]
    for ok, msg in checks:
        if not ok:
            p.error(msg)
    return args


def _device_ok(device: str) -> bool:
    try:
        return torch.device(device).type in ("cpu", "cuda")
    except (RuntimeError, ValueError):
        return False


def load_prompts(path: str | Path, field: str) -> list[str | list[int]]:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"prompts file {path} " + ("is a directory" if path.is_dir() else "does not exist"))
    prompts = []
    for lineno, row in iter_jsonl(path, UsageError):
        if not isinstance(row, dict):
            raise UsageError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        if field not in row:
            raise UsageError(f"{path}:{lineno}: no field {field!r} (fields: {', '.join(map(repr, row)) or 'none'})")
        prompt = row[field]
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) or is_ids) or not prompt:
            raise UsageError(f"{path}:{lineno}: field {field!r} must be a non-empty string or list of token ids")
        prompts.append(prompt)
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts


def load_engine(model_dir: str, device: str, dtype: str | None, tokenizer_dir: str | None = None,
                **config) -> LLMEngine:
    """Our model and a tokenizer, wrapped in an engine: `tokenizer_dir`'s (which must load), else the model
    directory's when it has one."""
    from model import CheckpointError, ModelConfigError, load_model
    from model.tokenizer import load_tokenizer
    try:
        model = load_model(model_dir, device=device, dtype=getattr(torch, dtype) if dtype else None)
    except (OSError, ModelConfigError, CheckpointError) as e:  # missing, unreadable, truncated, misshapen
        raise UsageError(f"--model: {e}") from None
    flag = "--tokenizer" if tokenizer_dir else "--model"
    try:
        tokenizer = load_tokenizer(tokenizer_dir or model_dir)
    except FileNotFoundError as e:
        if tokenizer_dir:
            raise UsageError(f"--tokenizer: {e}") from None
        tokenizer = None
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    if tokenizer is not None and len(tokenizer) > model.config.vocab_size:
        raise UsageError(f"{flag}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                         f"{model.config.vocab_size}")
    return LLMEngine(model, EngineConfig(device=device, **config), tokenizer=tokenizer)


def encode(engine: LLMEngine, prompts: list[str | list[int]], chat_template: bool) -> list[list[int]]:
    from model.tokenizer import encode_prompt
    vocab = engine.runner.model.config.vocab_size
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if engine.tokenizer is None:
                raise UsageError(f"prompt {i} is text but the model directory has no tokenizer: give --tokenizer DIR, "
                                 "or prompts as token ids")
            try:
                p = encode_prompt(engine.tokenizer, p, chat_template)
            except ValueError as e:
                raise UsageError(str(e)) from None
        if not all(0 <= t < vocab for t in p):
            raise UsageError(f"prompt {i}: token ids must be in [0, {vocab})")
        if len(p) >= engine.max_model_len:
            raise UsageError(f"prompt {i}: {len(p)} tokens leave no room to generate (max {engine.max_model_len})")
        out.append(p)
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse has printed its message
        return int(e.code or 0)
    cpu.enable()   # the C backend for CPU engines (cpu/)
    try:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise UsageError("--device cuda, but CUDA is not available")
        out_path = Path(args.out)
        if not out_path.parent.is_dir():
            raise UsageError(f"--out: directory {out_path.parent} does not exist")
        if out_path.is_dir():
            raise UsageError(f"--out: {out_path} is a directory; give a file name")
        prompts = load_prompts(args.prompts, args.prompt_field)
        engine = load_engine(args.model, args.device, args.dtype, args.tokenizer, max_num_seqs=args.max_num_seqs,
                             max_batch_tokens=max(4096, args.max_num_seqs), num_kv_tokens=args.num_kv_tokens,
                             cpu_decode_steps=16)   # a CPU engine: up to 16 decode steps a C call, the same tokens
        prompt_ids = encode(engine, prompts, args.chat_template)
    except UsageError as e:
        print(f"rollout.py: error: {e}", file=sys.stderr)
        return 2

    requests = []
    for i, ids in enumerate(prompt_ids):
        for j in range(args.n):
            params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                    max_new_tokens=args.max_new_tokens, seed=args.seed + i * args.n + j)
            requests.append(GenRequest(ids, params, group_id=i, sample_index=j, prompt_index=i))
    outputs = engine.generate(requests)

    tok = engine.tokenizer
    tmp = out_path.with_name(f".{out_path.name}.tmp{os.getpid()}")  # same directory: the rename is atomic
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for o in outputs:
                text = tok.decode(o.token_ids, skip_special_tokens=True) if tok is not None else None
                f.write(json.dumps(dict(prompt_index=o.prompt_index, sample_index=o.sample_index,
                                        token_ids=o.token_ids, text=text, logprobs=o.logprobs,
                                        finish_reason=o.finish_reason)) + "\n")
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)  # only still there if writing failed
    print(f"rollout.py: wrote {len(outputs)} samples for {len(prompt_ids)} prompts to {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

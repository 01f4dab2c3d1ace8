"""Turn a Config into the run's parts: tokenizer, prompt source, reward function, model weights, run directory."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from config import resolve_run_dir, save_config
from model import ModelConfig, Transformer, load_model
from model.presets import preset_config
from model.tokenizer import load_tokenizer
from rl.data import PromptDataset, PromptSampler
from rl.rewards import RewardResult, get_reward_fn
from rl.tasks import LengthDist, SyntheticTask
from runtime.reward_scorer import AsyncRewardScorer
from sched.controller import PromptItem
from sched.reward_timeout import AdaptiveTimeout


class PromptSource:
    """The controller's prompt supply: `source(n)` -> the next n prompts of the dataset's deterministic shuffled
    order (rl.data.PromptSampler), with the sampler's state for resume."""

    def __init__(self, sampler: PromptSampler):
        self.sampler = sampler

    def __call__(self, n: int) -> list[PromptItem]:
        return [PromptItem(p.index, p.prompt_ids, p.answer, p.max_new_tokens) for p in self.sampler.next_batch(n)]

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, s: dict[str, int]) -> None:
        self.sampler.load_state_dict(s)


@dataclass
class RunParts:
    model_cfg: ModelConfig
    tokenizer: Any
    reward_fn: Callable[[str, str], RewardResult]
    source: PromptSource | None       # leader only
    skipped_prompts: int = 0
    max_new_tokens: int = 0


def reward_fn(cfg: Any) -> Callable[[str, str], RewardResult]:
    kind = cfg.reward.kind
    return get_reward_fn(kind, timeout_s=cfg.reward.timeout_s) if kind == "math" else get_reward_fn(kind)


def reward_scorer(cfg: Any, fn: Callable[[str, str], RewardResult]) -> AsyncRewardScorer | None:
    """RollPacker §4.3's asynchronous scorer for a rollout rank (`reward.async_workers` threads, per-prompt adaptive
    timeout between `reward.timeout_min_s` and `reward.timeout_s`), or None: score inline (async_workers = 0)."""
    r = cfg.reward
    if not r.async_workers:
        return None
    params = AdaptiveTimeout.Params(scale=r.timeout_scale, min_s=r.timeout_min_s, max_s=r.timeout_s)
    return AsyncRewardScorer(fn, workers=r.async_workers, timeout=AdaptiveTimeout(params))


def build_run(cfg: Any, with_data: bool) -> RunParts:
    d = cfg.data
    task = None
    if d.source == "synthetic":
        task = SyntheticTask(d.task, d.num_prompts, d.seed, lengths=LengthDist(
            d.len_body_max, d.len_tail_min, d.len_tail_max, d.len_tail_frac))
        tok = task.tokenizer()
        reward = reward_fn(cfg)
    else:
        tok_dir = cfg.model.tokenizer or cfg.model.path
        if not tok_dir:
            raise ValueError("data.source is a file, so the run needs a tokenizer: set model.path or model.tokenizer")
        tok = load_tokenizer(tok_dir)
        reward = reward_fn(cfg)
    if cfg.model.path:
        mcfg = ModelConfig.from_dir(cfg.model.path)
    else:
        mcfg = preset_config(cfg.model.preset, vocab_size=len(tok) if cfg.model.preset == "tiny" else None,
                             eos_token_id=tok.eos_token_id)
    if len(tok) > mcfg.vocab_size:
        raise ValueError(f"the tokenizer has {len(tok)} tokens but the model's vocab_size is {mcfg.vocab_size}")
    source, skipped = None, 0
    if with_data:
        if task is not None:
            ds = PromptDataset.from_synthetic(task, tok, d.max_prompt_tokens, d.chat_template, d.cap_at_answer)
        else:
            ds = PromptDataset.from_file(d.source, tok, d.max_prompt_tokens, d.prompt_field, d.answer_field,
                                         d.chat_template, d.system_prompt)
        skipped = len(ds.skipped_too_long) + len(ds.skipped_rejected)
        source = PromptSource(PromptSampler(ds, d.seed, d.shuffle))
    return RunParts(mcfg, tok, reward, source, skipped, cfg.rollout.max_new_tokens)


def model_dtype(cfg: Any, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.model.dtype]


def device_for_rank(backend: str) -> torch.device:
    """This rank's device, from torchrun's LOCAL_RANK (the same rule init_distributed applies)."""
    if torch.cuda.is_available() and backend != "gloo":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def model_for_rank(cfg: Any, parts: RunParts, device: torch.device, is_train: bool) -> Transformer:
    """Full fp32 weights for a train rank (FSDP2 shards them; mixed precision casts on GPU); the engine's dtype
    for a rollout rank (whose weights are replaced by the trainer's first publication anyway)."""
    dtype = torch.float32 if is_train else model_dtype(cfg, device)
    if cfg.model.path:
        return load_model(cfg.model.path, device, dtype)
    with torch.device(device):
        model = Transformer(parts.model_cfg)
    return model.init_weights(seed=cfg.model.init_seed).to(dtype)


def make_run_dir(cfg: Any) -> str:
    run_dir = Path(resolve_run_dir(cfg))
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir)
    return str(run_dir)

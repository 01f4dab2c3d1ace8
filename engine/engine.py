"""LLMEngine: requests in, finished outputs out, one scheduled step at a time.

    engine = LLMEngine(model, EngineConfig(max_num_seqs=64))
    outputs = engine.generate([GenRequest(prompt_ids, SamplingParams(temperature=1.0, seed=i), group_id=g, ...)])

`step()` is schedule -> run the model -> sample -> append tokens and retire finished sequences. Around it: `abort`,
`export` / `import_request` (move an unfinished request between engines, with its KV), `load_weights` (new weights
tagged with a version; running sequences are recomputed under them, so no KV from the old weights is reused, unless
`keep_kv`: then they go on decoding on the KV they have),
`reset` (drop everything after a failed step) and `stats`. A multi-turn request is held when a turn stops, then
`extend`ed with an observation (its KV kept across turns) or `end`ed (engine/turns.py). A backend may serve a device
with a subclass (`register_engine`; the optional cpu/ package registers its CPU engine): `LLMEngine(...)` builds it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from engine import turns
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.runner import ModelRunner
from engine.sampler import ERROR_TOKEN, Sampler
from engine.sampling import SamplingParams
from engine.scheduler import EngineStats, ScheduledBatch, Scheduler
from engine.sequence import GenRequest, KVState, RequestId, RequestOutput, Sequence, UnfinishedRequest
from model.transformer import Transformer


@dataclass
class StepStats:
    """What the last step did (for benchmarks and the engine's event stream)."""
    num_seqs: int = 0  # sequences that computed tokens
    num_tokens: int = 0  # tokens computed (prefill + decode)
    num_decode: int = 0  # sequences that computed exactly one token
    num_sampled: int = 0
    context_tokens: int = 0  # sum over computed sequences of their context length (KV tokens attended to)
    seconds: float = 0.0
    steps: int = 1  # model steps the call ran (several where a backend's engine runs decode steps ahead)


# Engine subclasses a backend registered (`register_engine`): each a function of (model, config) giving the class
# that serves them, or None (the optional cpu/ package: its CPU engine for models on the CPU).
ENGINES: list[Callable[[Transformer, EngineConfig], type[LLMEngine] | None]] = []


def register_engine(pick: Callable[[Transformer, EngineConfig], type[LLMEngine] | None]) -> None:
    """Register a backend's engine: `pick(model, config)` gives the LLMEngine subclass that serves them, or None."""
    if pick not in ENGINES:
        ENGINES.append(pick)


class LLMEngine:
    runner_class: type[ModelRunner] = ModelRunner

    def __new__(cls, model: Transformer | None = None, config: EngineConfig | None = None, *args, **kwargs):
        """`LLMEngine(...)` builds the subclass the first registered backend picks for the model and config."""
        if cls is LLMEngine and model is not None:
            cfg = config or EngineConfig()
            cls = next((c for c in (pick(model, cfg) for pick in ENGINES) if c is not None), cls)
        return super().__new__(cls)

    def __init__(self, model: Transformer, config: EngineConfig | None = None, tokenizer=None, version: int = 0,
                 clock: Callable[[], float] = time.time):
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.version = version
        self.clock = clock
        self.runner = self.runner_class(model, config)
        self.device = self.runner.device
        self.block_manager, self.scheduler = self._fresh_pool()
        self.sampler = Sampler(self.device, config.seed, fused=config.fused_sampling)
        self.eos_ids = eos_ids(model.config.eos_token_id, tokenizer)
        self.seqs: dict[RequestId, Sequence] = {}  # unfinished requests by id
        self.kept: dict[RequestId, list[int]] = {}  # blocks held for KV exported with its request (`export`)
        self.num_steps = self.num_tokens_decoded = self.num_prefill_tokens = 0
        self.last_step = StepStats()

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(self, request: GenRequest | list[int] | str, params: SamplingParams | None = None) -> RequestId:
        """Queue a request (or a prompt, as token ids or text when the engine has a tokenizer). Returns its id."""
        if not isinstance(request, GenRequest):
            request = GenRequest(self._encode(request), params or SamplingParams())
        return self._add(Sequence(request, self.clock()))

    def _add(self, seq: Sequence) -> RequestId:
        if seq.request_id in self.seqs:
            raise ValueError(f"request id {seq.request_id!r} is already in this engine")
        if seq.num_tokens >= self.max_model_len:
            raise ValueError(f"request {seq.request_id}: {seq.num_tokens} tokens leave no room to generate within "
                             f"max_model_len={self.max_model_len}")
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def _encode(self, prompt: list[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs an engine built with a tokenizer")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the requests that finished in it."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            self.last_step = StepStats()
            return []
        return self.run_batch(batch, t0)

    def run_batch(self, batch: ScheduledBatch, t0: float) -> list[RequestOutput]:
        """The step of a scheduled batch: run the model, sample, append the tokens, retire finished sequences."""
        logits = self.runner.run(batch)
        tokens, logprobs, sampling_logprobs = [], [], []
        if batch.sample_seqs:
            if len(batch.sample_rows) != logits.shape[0]:  # else every row samples, in order (sample_rows ascend)
                logits = logits[torch.tensor(batch.sample_rows, dtype=torch.long).to(logits.device, non_blocking=True)]
            tokens, logprobs, sampling_logprobs = self.sampler(
                logits, [s.params for s in batch.sample_seqs], [s.num_generated for s in batch.sample_seqs])
        self.scheduler.postprocess(batch)
        now, finished, version = self.clock(), [], self.version
        for seq, tok, lp, slp in zip(batch.sample_seqs, tokens, logprobs, sampling_logprobs):
            if tok == ERROR_TOKEN:  # non-finite logits (engine/sampler.py): ends the request, no token appended
                reason = "error"
            else:
                seq.append(tok, lp, slp, version, now)
                reason = self._stop_reason(seq, tok)
            if reason is not None:
                finished.append(self.retire(seq, reason, now))
        self.num_steps += 1
        self.num_tokens_decoded += len(tokens)
        self.num_prefill_tokens += batch.num_batched_tokens - batch.num_decode
        self.last_step = StepStats(
            len(batch.seqs), batch.num_batched_tokens, batch.num_decode, len(tokens),
            sum(s.num_cached_tokens for s in batch.seqs), time.perf_counter() - t0)
        return finished

    def retire(self, seq: Sequence, reason: str, now: float) -> RequestOutput:
        """Finish a sequence (its blocks back to the pool) and return its output; a multi-turn request whose turn
        stopped is held instead (engine/turns.py)."""
        if reason == "stop" and seq.request.multi_turn:
            return turns.hold(self, seq, now)
        seq.finish_reason, seq.finish_time = reason, now
        self.scheduler.finish(seq)
        return self.seqs.pop(seq.request_id).output()

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p, n = seq.params, len(seq.token_ids)  # plain attributes: this runs for every token of every step
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            return "stop"
        if n - seq.num_prompt_tokens >= p.max_new_tokens or n >= self.runner.max_model_len:
            return "length"
        return None

    def generate(self, requests: Iterable[GenRequest | list[int] | str],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run the given requests to completion (along with anything already queued); outputs in input order."""
        ids = [self.add_request(r, params) for r in requests]
        wanted, done = set(ids), {}
        while wanted - done.keys():
            if not self.has_unfinished():
                raise RuntimeError("requests vanished from the engine (aborted or exported during generate)")
            outs = self.step()
            if not outs and not self.last_step.num_seqs:
                raise RuntimeError("the engine made no progress: no waiting request could be admitted")
            done.update((o.request_id, o) for o in outs if o.request_id in wanted)
        return [done[i] for i in ids]

    # ---- multi-turn requests (engine/turns.py) ------------------------------------------------------------------
    def extend(self, request_id: RequestId, token_ids: list[int]) -> None:
        """Append an observation's tokens to a held multi-turn request and queue its next turn: only the new tokens
        (and the last sampled one) are prefilled, unless its KV was dropped meanwhile."""
        turns.extend(self, request_id, token_ids)

    def room(self, request_id: RequestId) -> int:
        """How many tokens a held request can be extended by and still generate one."""
        return turns.room(self, request_id)

    def end(self, request_id: RequestId, reason: str = "stop") -> RequestOutput:
        """Finish a held multi-turn request (its episode is over); its final output."""
        return turns.end(self, request_id, reason)

    # ---- taking requests out, putting them in ---------------------------------------------------------------------
    def abort(self, request_id: RequestId) -> RequestOutput | None:
        """Stop a request now (a held one too: its blocks back). Returns its output so far (finish_reason "abort"),
        or None if it is not here."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        seq.finish_reason, seq.finish_time = "abort", self.clock()
        return seq.output()

    def export(self, request_id: RequestId, with_kv: bool = False) -> UnfinishedRequest:
        """Take an unfinished request out of this engine, to be resumed elsewhere with `import_request`. `with_kv`:
        carry a copy of the K/V of its cached tokens too (none when it holds none: waiting, or preempted). The copy
        stays within this engine's KV budget: as many blocks as it fills are held out of the pool until
        `release_kv` (the caller's, once the copy is sent or dropped)."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            raise KeyError(f"no unfinished request {request_id!r} in this engine")
        kv = None
        if with_kv and seq.num_cached_tokens > 0:
            kv = KVState(self.runner.read_kv(seq.block_table, seq.num_cached_tokens), self.version)
        u = seq.unfinished()
        self.scheduler.remove(seq)
        if kv is not None:
            self.release_kv(request_id)
            self.kept[request_id] = self.block_manager.hold(-(-kv.num_tokens // self.config.block_size))
        u.kv = kv
        return u

    def release_kv(self, request_id: RequestId) -> None:
        """The KV exported with `request_id` is gone (sent, dropped or imported back): its blocks return to the pool."""
        ids = self.kept.pop(request_id, None)
        if ids:
            self.block_manager.release(ids)

    def import_request(self, unfinished: UnfinishedRequest) -> RequestId:
        """Resume a request exported from another engine. Its KV (`unfinished.kv`), when computed by the weights of
        this engine's version and when a seat and the blocks are free now, is written into this pool and the request
        runs at once with those tokens cached: its next step computes only what was left (a decode), nothing is
        re-prefilled. Otherwise (no KV, KV of another weight version, which must never be read as cached, or no room)
        prompt + generated tokens are re-prefilled here. KV of another model's shape or dtype is a ValueError. A
        multi-turn request exported while held comes back held (to be `extend`ed), with its KV when it can adopt it
        and the blocks are free (no seat needed)."""
        seq = Sequence.resume(unfinished)
        kv = unfinished.kv
        if kv is not None:
            want = self.runner.kv_shape(kv.num_tokens)
            if tuple(kv.data.shape) != want or kv.data.dtype != self.runner.dtype:
                raise ValueError(f"request {seq.request_id}: KV of shape {tuple(kv.data.shape)} {kv.data.dtype} does "
                                 f"not fit this engine's {want} {self.runner.dtype}")
            if not 0 < kv.num_tokens < seq.num_tokens:
                raise ValueError(f"request {seq.request_id}: KV of {kv.num_tokens} tokens for a request of "
                                 f"{seq.num_tokens} (at least the last token is left to compute)")
        request_id = self._add(seq)
        adopt = kv is not None and kv.version == self.version
        if unfinished.held:   # its turn had ended: held again, to be extended
            if self.scheduler.park(seq, kv.num_tokens if adopt else 0):
                self.runner.write_kv(seq.block_table, kv.data)
                seq.num_cached_tokens = kv.num_tokens
            seq.finish_reason = "stop"
        elif adopt and self.scheduler.admit_cached(seq, kv.num_tokens):
            self.runner.write_kv(seq.block_table, kv.data)
            seq.num_cached_tokens = kv.num_tokens
        return request_id

    def reset(self) -> list[RequestId]:
        """Drop every request and rebuild the block pool's bookkeeping from scratch, as after a failed step (whose
        half-done updates cannot be trusted); the KV pool is zeroed (masked-out garbage must be finite), the weights
        and the counters stay. Returns the ids dropped."""
        dropped = list(self.seqs)
        self.seqs.clear()
        self.kept.clear()
        counts = self.scheduler.num_preemptions, self.scheduler.num_evictions
        self.block_manager, self.scheduler = self._fresh_pool()
        self.scheduler.num_preemptions, self.scheduler.num_evictions = counts
        for cache in (*self.runner.k_caches, *self.runner.v_caches):
            cache.zero_()
        return dropped

    def _fresh_pool(self) -> tuple[BlockManager, Scheduler]:
        """An empty block pool and the scheduler over it (at start-up, and after a failed step)."""
        c = self.config
        bm = BlockManager(self.runner.num_blocks, c.block_size)
        return bm, Scheduler(bm, c.max_num_seqs, c.max_batch_tokens, c.chunked_prefill)

    def weights_finite(self) -> bool:
        """Whether every weight of the model is finite (a corrupted engine's are not)."""
        return all(bool(torch.isfinite(p).all()) for p in self.runner.model.state_dict().values()
                   if p.is_floating_point())

    # ---- weights ----------------------------------------------------------------------------------------------
    def load_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int,
                     keep_kv: bool = False) -> int:
        """Copy new weights into the model in place and tag what is generated from now on with `version`. Running
        sequences are preempted (recomputed under the new weights when they resume): no KV computed by the old
        weights is read again (AReaL's interrupt). With `keep_kv` they are not: they keep their KV, computed by the
        old weights, and their next tokens are decoded under the new ones (PipelineRL's in-flight weight update,
        arXiv 2509.19128). Tokens generated before keep their old version. The KV kept by held multi-turn requests
        goes (or stays, with `keep_kv`) alike. Returns the tensor count."""
        n = self.runner.load_weights(weights)
        if not keep_kv:
            self.scheduler.preempt_all()
        self.version = version
        return n

    # ---- reporting ----------------------------------------------------------------------------------------------
    def running_with_kv(self) -> int:
        """Running sequences that hold KV: read before and after `load_weights`, how many kept theirs."""
        return sum(1 for s in self.scheduler.running if s.block_table)

    def stats(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        return EngineStats(
            version=self.version, running=[s.request_id for s in sch.running],
            waiting=[s.request_id for s in sch.waiting], kv_blocks_used=bm.num_used, kv_blocks_free=bm.num_free,
            kv_blocks_total=bm.num_blocks, block_size=bm.block_size, num_tokens_decoded=self.num_tokens_decoded,
            num_prefill_tokens=self.num_prefill_tokens, num_steps=self.num_steps,
            num_preemptions=sch.num_preemptions, time=self.clock(), held=list(sch.held),
            num_evictions=sch.num_evictions)


def eos_ids(model_eos: int | list[int] | None, tokenizer: Any) -> frozenset[int]:
    """The ids that end a response: the model config's EOS (one or several) and the tokenizer's."""
    ids = set([model_eos] if isinstance(model_eos, int) else model_eos or [])
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)

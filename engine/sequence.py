"""Requests in, outputs out, and the engine's per-sequence state in between.

A `GenRequest` is what a caller submits (prompt tokens, sampling params, GRPO group id and sample index). The engine
turns it into a `Sequence` (token ids, KV block table, generated logprobs and versions) and, when it finishes or is
aborted, into a `RequestOutput`. A multi-turn request (`GenRequest.multi_turn`) is held when a turn ends and extended
with an observation's tokens (engine/turns.py): its response interleaves sampled and appended tokens, told apart by
its `mask`. An unfinished sequence can leave one engine as an `UnfinishedRequest` and resume
in another, with its KV (`KVState`) when the engines share weights. Only `KVState` holds tensors.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

from engine.sampling import SamplingParams

if TYPE_CHECKING:  # KVState's annotation only: this module stays importable without touching torch
    import torch

_ids = itertools.count()
RequestId = int | str   # the caller's (the rollout worker uses the controller's int req_id); "req-N" when not given


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: RequestId | None = None  # assigned by the engine when None
    group_id: int = -1  # GRPO group: samples of one group with the same prompt share its KV blocks
    sample_index: int = 0
    prompt_index: int = -1  # position of the prompt in the dataset, carried through for logs
    multi_turn: bool = False  # a turn's stop (EOS, stop token) holds the request for `LLMEngine.extend`

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        if not self.prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        if self.request_id is None:
            self.request_id = f"req-{next(_ids)}"


@dataclass
class RequestOutput:
    """A finished (or aborted) request. `logprobs[i]`: log p(token_ids[i]) under the raw model with the request's
    temperature applied and no top-k/top-p truncation (temperature 1 for greedy requests) -- the behaviour-policy
    logprob the trainer's importance ratio needs. `sampling_logprobs[i]`: under the distribution actually sampled
    from (after top-k/top-p; 0.0 for greedy). `versions[i]`: the weight version that produced token i."""
    request_id: RequestId
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error" (non-finite logits)
    group_id: int = -1
    sample_index: int = 0
    prompt_index: int = -1
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float = 0.0
    num_preemptions: int = 0
    # Multi-turn requests: per response token 1 = sampled, 0 = appended by `extend` (logprob 0.0); None otherwise.
    mask: list[int] | None = None
    held: bool = False  # a multi-turn request's turn ended: it waits in the engine for `extend` or `end`

    @property
    def version(self) -> int:
        """The oldest weight version among the generated tokens (-1 if none were generated)."""
        return min(self.versions) if self.versions else -1


@dataclass
class KVState:
    """The K and V of a request's first `num_tokens` tokens as an engine's pool held them: `data` is
    [2, num_layers, num_tokens, num_kv_heads, head_dim] (K then V), computed by the weights of `version`."""
    data: torch.Tensor
    version: int

    @property
    def num_tokens(self) -> int:
        return self.data.shape[2]


@dataclass
class UnfinishedRequest:
    """A request taken out of one engine mid-generation, to be resumed by another (`LLMEngine.import_request`),
    which adopts `kv` when it was computed by the same weights, else re-prefills prompt + generated tokens, and
    carries on. A seeded request's draws are a function of (seed, token index) (engine/sampler.py), so its
    continuation is the one the first engine would have produced."""
    request: GenRequest
    token_ids: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float]
    versions: list[int]
    arrival_time: float
    first_token_time: float | None = None
    num_preemptions: int = 0
    kv: KVState | None = None  # the KV of the tokens the exporting engine had cached (`LLMEngine.export(with_kv=True)`)
    mask: list[int] | None = None  # a multi-turn request's per-token mask (RequestOutput.mask)
    held: bool = False  # exported while held (its turn had ended): imported held, to be extended


class SeqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    HELD = auto()  # a multi-turn request between turns: no seat, its blocks kept (while the pool can spare them)
    FINISHED = auto()


class Sequence:
    """Engine-side state of one request. `token_ids` = prompt + generated; the first `num_cached_tokens` of them
    have their K/V in the pool (in the blocks of `block_table`). Each step computes some of the rest; when it
    reaches the end, the step samples the next token. Decode is the case of exactly one token left to compute."""

    def __init__(self, request: GenRequest, arrival_time: float):
        self.request = request
        self.request_id: RequestId = request.request_id  # type: ignore[assignment]
        self.params = request.params
        self.token_ids: list[int] = list(request.prompt_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.status = SeqStatus.WAITING
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.table_synced = 0  # the runner's copy of block_table is valid for entries [0, table_synced)
        self.seat = -1  # row of the runner's block-table tensor while running
        self.logprobs: list[float] = []
        self.sampling_logprobs: list[float] = []
        self.versions: list[int] = []
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.finish_time = 0.0
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self.leader: Sequence | None = None  # a group sibling being prefilled that this one will fork from
        self.forks: list[Sequence] = []  # siblings waiting to fork from this one once its prompt is prefilled
        self.appended: list[tuple[int, int]] = []  # [start, end) of the tokens `observe` appended, generated index

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}, {self.status.name}, tokens={len(self.token_ids)}, "
                f"cached={self.num_cached_tokens}, blocks={self.block_table})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def can_fork(self) -> bool:
        """Fresh (nothing computed or generated) and part of a group, so group siblings may share its prompt."""
        return self.request.group_id >= 0 and self.num_generated == 0 and self.num_cached_tokens == 0

    def same_prompt(self, other: Sequence) -> bool:
        return (self.request.group_id == other.request.group_id
                and self.request.prompt_ids == other.request.prompt_ids)

    def append(self, token: int, logprob: float, sampling_logprob: float, version: int, now: float) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.sampling_logprobs.append(sampling_logprob)
        self.versions.append(version)
        if self.first_token_time is None:
            self.first_token_time = now

    def extend(self, tokens: list[int], logprobs: list[float], version: int, now: float) -> None:
        """`append` for several tokens sampled plainly (their sampling logprobs are their logprobs)."""
        self.token_ids += tokens
        self.logprobs += logprobs
        self.sampling_logprobs += logprobs
        self.versions += [version] * len(tokens)
        if self.first_token_time is None:
            self.first_token_time = now

    def observe(self, tokens: list[int], version: int) -> None:
        """Append tokens the model did not sample (a multi-turn request's observation): logprob 0.0, mask 0."""
        start = self.num_generated
        self.token_ids += tokens
        self.logprobs += [0.0] * len(tokens)
        self.sampling_logprobs += [0.0] * len(tokens)
        self.versions += [version] * len(tokens)
        self.appended.append((start, start + len(tokens)))

    def mask(self) -> list[int] | None:
        """Per generated token 1 (sampled) or 0 (appended); None for a single-turn request."""
        if not self.request.multi_turn:
            return None
        mask = [1] * self.num_generated
        for a, b in self.appended:
            mask[a:b] = [0] * (b - a)
        return mask

    def output(self) -> RequestOutput:
        r = self.request
        return RequestOutput(
            request_id=self.request_id, prompt_ids=list(r.prompt_ids),
            token_ids=self.token_ids[self.num_prompt_tokens:],
            logprobs=list(self.logprobs), sampling_logprobs=list(self.sampling_logprobs), versions=list(self.versions),
            finish_reason=self.finish_reason or "abort", group_id=r.group_id, sample_index=r.sample_index,
            prompt_index=r.prompt_index, arrival_time=self.arrival_time, first_token_time=self.first_token_time,
            finish_time=self.finish_time, num_preemptions=self.num_preemptions, mask=self.mask(),
            held=self.status is SeqStatus.HELD)

    def unfinished(self) -> UnfinishedRequest:
        return UnfinishedRequest(
            request=self.request, token_ids=self.token_ids[self.num_prompt_tokens:], logprobs=list(self.logprobs),
            sampling_logprobs=list(self.sampling_logprobs), versions=list(self.versions),
            arrival_time=self.arrival_time, first_token_time=self.first_token_time,
            num_preemptions=self.num_preemptions, mask=self.mask(), held=self.status is SeqStatus.HELD)

    @classmethod
    def resume(cls, u: UnfinishedRequest) -> Sequence:
        seq = cls(u.request, u.arrival_time)
        seq.token_ids += list(u.token_ids)
        seq.logprobs, seq.sampling_logprobs = list(u.logprobs), list(u.sampling_logprobs)
        seq.versions = list(u.versions)
        seq.first_token_time = u.first_token_time
        seq.num_preemptions = u.num_preemptions
        if u.mask is not None:  # the appended spans back from the mask
            if len(u.mask) != len(u.token_ids):
                raise ValueError(f"request {seq.request_id}: a mask of {len(u.mask)} for {len(u.token_ids)} tokens")
            seq.appended = spans(u.mask, 0)
        return seq


def spans(mask: list[int], value: int) -> list[tuple[int, int]]:
    """The [start, end) runs of `value` in `mask`."""
    out, start = [], None
    for i, m in enumerate([*mask, None]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out

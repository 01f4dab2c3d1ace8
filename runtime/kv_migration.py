"""A rollout rank's side of KV migration (`perf.migrate_kv`; runtime/kv_transfer.py moves the tensors) and the
resume of a request from its partial trajectory.

A migrating Interrupt (`dst` set) keeps the request's KV aside here (`out`) and tags the partial with this rank
(`kv_rank`); the controller's SendKV sends it to the rank about to resume the request. A Start whose partial is
tagged with another rank receives that KV on the receiving thread while the engine decodes on (`incoming`), and the
request joins the engine once the KV is in: adopted as cached when computed by the weights the engine holds (no
re-prefill), else re-prefilled (`adopted` / `refused` count the tokens). Kept KV is dropped at a LoadWeights (a
SendKV then sends "no KV"), at an abort of its request, at an engine failure and at Stop. Without a KV group every
resumed request is re-prefilled.

Invariant kept: every receive announced to a sender completes, since the sender waits for it: one whose Start was
voided by an engine failure is still received, then dropped (`void`).
"""
from __future__ import annotations

import torch.distributed as dist

from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import GenRequest, KVState, UnfinishedRequest
from runtime.kv_transfer import KeptKV, KVReceiver, KVSender
from runtime.messages import StartRequest


class KVMigration:
    """The KV kept here for a SendKV (`out`), the Starts whose KV is on the way (`incoming`), the receives to
    complete and drop (`void`), the adopted / refused token counts; and `resume`, which queues a request from its
    partial trajectory with or without KV."""

    def __init__(self, engine: LLMEngine, kv_group: dist.ProcessGroup | None, *, rank: int):
        self.engine, self.rank = engine, rank
        self.sender = KVSender(kv_group) if kv_group is not None else None   # None: migrated requests re-prefill
        self.receiver = KVReceiver(kv_group, engine.device) if kv_group is not None else None
        self.incoming: dict[int, StartRequest] = {}   # req_id -> its Start, while its KV is on the way
        self.out = KeptKV(engine)                     # req_id -> KV kept since its migrating Interrupt
        self.void: set[int] = set()                   # KV receives to complete and drop (sent pre-failure)
        self.adopted = self.refused = 0               # tokens of received KV imported as cached / not

    @property
    def keeps_kv(self) -> bool:
        """A migrating Interrupt keeps the request's KV for a SendKV (this rank has a KV group)."""
        return self.sender is not None

    @property
    def pending(self) -> bool:
        """Receives still to take in."""
        return bool(self.incoming or self.void)

    def send(self, req_id: int, dst: int) -> None:
        """SendKV: send the KV kept for `req_id` (or "no KV", when it was dropped) to rank `dst`."""
        if self.sender is None:
            raise RuntimeError(f"rank {self.rank} told to send KV but it has no KV group")
        self.sender.send(self.out.pop(req_id, None), req_id, dst)

    def expect(self, req: StartRequest, src: int) -> None:
        """A Start whose KV is on rank `src`: receive it on the receiving thread; `take` hands the request back."""
        if self.receiver is None:
            raise RuntimeError(f"rank {self.rank}: request {req.req_id} comes with KV on rank {src} but this rank "
                               f"has no KV group")
        self.receiver.receive(req.req_id, src)
        self.incoming[req.req_id] = req

    def expect_void(self, req_id: int, src: int) -> None:
        """A receive announced to rank `src` for a Start that is void here: complete it, then drop the KV."""
        if self.receiver is not None:
            self.receiver.receive(req_id, src)
            self.void.add(req_id)

    def take(self, wait: bool = False) -> list[tuple[StartRequest, KVState | None]]:
        """The Starts whose KV is in, with it (`wait`: after waiting for every one still coming)."""
        ready = []
        if self.incoming or self.void:
            for req_id, kv in (self.receiver.wait_all() if wait else self.receiver.take()):
                if req_id in self.void:   # announced before the engine failed: dropped
                    self.void.discard(req_id)
                else:
                    ready.append((self.incoming.pop(req_id), kv))
        return ready

    def void_incoming(self) -> dict[int, int]:
        """At an engine failure: the Starts whose KV is on the way are void (their receives still complete, then
        the KV is dropped); returns their tokens so far by request id."""
        held = {rid: len(req.partial.response_ids) for rid, req in self.incoming.items()}
        self.void.update(self.incoming)
        self.incoming.clear()
        return held

    def resume(self, req: StartRequest, params: SamplingParams, kv: KVState | None, multi_turn: bool = False,
               held: bool = False) -> None:
        """Queue a request resumed from its partial trajectory: its tokens so far are re-prefilled, or adopted as
        cached from `kv` when that was computed by this engine's weights. Its seed is the same and its draws are a
        function of (seed, token index), so the continuation is the one the first engine would have produced under
        the same weights; max_new_tokens counts the carried tokens too. A multi-turn request carries its loss mask
        (no mask: every token the model's); `held`: its last turn had ended (imported held, to be extended)."""
        part = req.partial
        request = GenRequest(req.prompt_ids, params, request_id=req.req_id, group_id=req.group_id,
                             sample_index=req.sample_index, prompt_index=req.prompt_index, multi_turn=multi_turn)
        mask = None
        if multi_turn:
            mask = list(part.loss_mask) if part.loss_mask is not None else [1] * len(part.response_ids)
        ids, lps, versions = list(part.response_ids), list(part.logprobs), list(part.versions)
        if not len(ids) == len(lps) == len(versions):
            raise ValueError(f"rank {self.rank}: request {req.req_id} resumed with {len(ids)} tokens, "
                             f"{len(lps)} logprobs and {len(versions)} versions")
        if versions and max(versions) > self.engine.version:
            raise ValueError(f"rank {self.rank}: request {req.req_id} has tokens of version {max(versions)} "
                             f"but this engine holds version {self.engine.version} (tokens never go back)")
        # The sampled-distribution logprobs of earlier parts are not carried (nothing downstream reads them).
        self.engine.import_request(UnfinishedRequest(
            request, token_ids=ids, logprobs=lps, sampling_logprobs=[float("nan")] * len(ids),
            versions=versions, arrival_time=self.engine.clock(), kv=kv, mask=mask, held=held))
        if kv is not None:   # refused: computed by other weights, or no room now (re-prefilled instead)
            adopted = self.engine.seqs[req.req_id].num_cached_tokens > 0
            self.adopted += kv.num_tokens * adopted
            self.refused += kv.num_tokens * (not adopted)

    def close(self) -> None:
        """Drop the KV still kept; wait until the KV this rank was told to send is taken."""
        self.out.clear()
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()

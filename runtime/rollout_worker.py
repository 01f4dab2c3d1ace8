"""The rollout partition's worker loop: one decode engine per rollout rank, driven by the leader's messages
(runtime/messages.py; the worker dispatches on their type):

    Start            add requests (prompt ids, group id, sample index, answer) to the engine; a request with a
                     `partial` trajectory resumes: prompt + tokens so far are re-prefilled and generation goes on
    Interrupt        take running requests out of the engine and hand back their tokens so far
                     (trajectory_interrupted, payload = the partial Trajectory); ids not held: ignored. A migration's
                     (`dst` set) keeps the request's KV aside here and tags the partial with this rank (`kv_rank`)
    SendKV           send a kept KV to the rank about to resume that request (runtime/kv_transfer.py); a Start
                     whose partial is tagged with another rank receives it on the receiving thread while the engine
                     decodes on, and the request joins the engine once it is in: adopted as cached when computed by
                     the weights the engine holds (no re-prefill), else re-prefilled. Kept KV is dropped at a
                     LoadWeights (a SendKV then sends "no KV") and at Stop
    ReceiveWeights   join the publication broadcast on the relay's thread while the engine decodes on (Laminar
                     §4: relays off the decode path); the weights fill this rank's relay (CPU copy) whole once
                     received (`weights_received`: seconds, tokens decoded meanwhile)
    LoadWeights      adopt the relay's weights in the engine (the weight-sync policy says when). The relay holds
                     only the newest publication, so the engine adopts that one, at least the version asked for;
                     `weights_loaded` says which
    Abort            stop requests; report them aborted (requeued or dropped); drop the KV kept for one
                     (no event: it was not in the engine)
    Stop             leave the loop
    ResetEngine      (after this rank reported `engine_failed`) the controller took the engine's requests back: the
                     engine may rebuild and rejoin

Fault isolation (Laminar §3.3), when the preset's mechanisms isolate engine faults (Preset.failures_isolated; never
in colocated mode, where the rank is a trainer shard too): the counters carry each request's new tokens (payload
`partials`) to the controller's partial-response pool (sched/partials.py). An exception in the engine's step (an
allocation failure included) or non-finite logits fail the engine, not the rank: it drops everything it held,
reports `engine_failed` (with what it held) and voids the Starts and LoadWeights that arrive until the controller's
ResetEngine; it then rebuilds (weights that are not finite reloaded from the relay) and reports `engine_recovered`.
Publications and KV transfers go on throughout, so no peer waits for it. Past `failures_isolated` failures, or when
a rebuild fails, the engine is retired and the run goes on without it.

Request ids are the controller's int `req_id` end to end, the engine's request id included. Between messages the
engine steps. Finished samples are scored beside the engine (as in the papers' disaggregated setups) and sent back
as events, batched one message per engine step:

- inline (`reward.async_workers = 0`, the default): each finished sample is scored in `step` before the next
  engine step; its `trajectory_finished` and `reward_scored` go out together.
- asynchronous (RollPacker §4.3, `reward.async_workers > 0`): `trajectory_finished` goes out at once, the sample
  goes to a `runtime.reward_scorer.AsyncRewardScorer` (a thread pool under an adaptive per-prompt timeout capped at
  `reward.timeout_s`) and decoding goes on; each score becomes a `reward_scored` event (same data and payload as
  inline) at the first engine step, or the first poll of an idle loop, after it is in. While scores are pending
  the loop polls the control channel instead of blocking on it. A verifier that raises, or runs past its timeout,
  scores 0 with `failed` set. `engine_idle` still means "nothing decoding": pending scores keep no engine busy.
  A request already finished is no longer in the engine, so an abort or interrupt of it does nothing here (no
  event): its one `reward_scored` still comes, and the controller discards it if it dropped the request
  (sched/lifecycle.py). At Stop the scores already in are sent and the rest are cancelled (the controller is done).

Deadlines (runtime/watchdog.py): the wait for the next message and a publication's broadcast are waits on the
leader; every engine step, scored sample and handled message is progress, which renews the waits of the ranks
waiting on this one (the controller, for events).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch
import torch.distributed as dist

from config import Config
from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import GenRequest, KVState, RequestOutput, UnfinishedRequest
from rl.rewards import RewardResult
from rl.types import Trajectory
from runtime.build import RunParts, reward_scorer
from runtime.channel import WORKER, Channel, ChannelTimeout
from runtime.background import InOrder
from runtime.kv_transfer import KeptKV, KVReceiver, KVSender
from runtime.messages import ReceiveWeights, SendKV, Start, StartRequest, Stop
from runtime.reward_scorer import AsyncRewardScorer
from runtime.topology import Topology
from runtime.watchdog import Phase, doing, injected_engine_fault, progress, waiting
from sched.base import Preset
from sched.decisions import Abort, Interrupt, LoadWeights, ResetEngine
from sched.events import Event
from trainer.publish import WeightReceiver, checksum


class WeightMismatchError(RuntimeError):
    """An engine's weights differ from what the trainer published."""


@dataclass
class SamplingConfig:
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int
    counters_every: int = 8  # send a tokens_decoded event every N engine steps, and at the step that empties it
    ignore_eos: bool = False
    report_progress: bool = False   # counters carry each request's tokens so far (Preset.reads_progress)
    counters_every_s: float | None = None   # and a busy engine sends them at least this often (Preset)


class Health(str, Enum):
    """The engine's state under fault isolation (Laminar §3.3; the module docstring)."""
    OK = "ok"                 # it runs
    FAILED = "failed"         # its step failed; reported; what the controller sent before it heard is void here
    REBUILDING = "rebuilding"  # the controller took its requests back (ResetEngine): it rebuilds, then rejoins


def request_seed(run_seed: int, group_id: int, sample_index: int) -> int:
    """Per-sample seed: a sample's tokens do not depend on batching, engine or timing (reproducible runs)."""
    return (run_seed * 1_000_003 + group_id * 9_973 + sample_index) % (2**63 - 1)


def trajectory_of(out: RequestOutput) -> Trajectory:
    """A finished engine output as a GRPO trajectory (engine timings in `meta`); reward not yet scored."""
    return Trajectory(
        group_id=out.group_id, sample_index=out.sample_index, prompt_ids=list(out.prompt_ids),
        response_ids=list(out.token_ids), logprobs=list(out.logprobs), versions=list(out.versions),
        finish_reason=out.finish_reason, prompt_index=out.prompt_index,
        meta=dict(arrival_time=out.arrival_time, first_token_time=out.first_token_time, finish_time=out.finish_time,
                  num_preemptions=out.num_preemptions))


class RolloutWorker:
    def __init__(self, engine: LLMEngine, channel: Channel, *, engine_index: int, rank: int,
                 reward_fn: Callable[[str, str], RewardResult], decode: Callable[[list[int]], str],
                 receiver: WeightReceiver | None, sampling: SamplingConfig, t0: float,
                 verify_weights: bool = False, scorer: AsyncRewardScorer | None = None,
                 kv_group: dist.ProcessGroup | None = None, failures_isolated: int = 0):
        self.engine, self.channel, self.engine_index, self.rank = engine, channel, engine_index, rank
        self.reward_fn, self.decode, self.receiver, self.sampling = reward_fn, decode, receiver, sampling
        self.t0 = t0
        self.answers: dict[int, str | None] = {}               # req_id -> its reference answer
        self.relay: dict[str, torch.Tensor] = {}
        self.relay_version = -1
        self.relay_sums: dict[str, int] = {}
        self.publications = InOrder("relay-receiver")          # publications arriving, in the order announced
        self.notices: dict[int, tuple[float, int]] = {}        # version -> (when announced, tokens decoded by then)
        self.verify_weights = verify_weights
        self.scorer = scorer                                   # None: score inline in `step`
        self.scoring: dict[int, tuple[int, int, Trajectory]] = {}   # scorer key -> (req_id, version, trajectory)
        self.next_key = 0
        self.outbox: list[Event] = []
        self.busy = False
        self.steps = 0
        self.counters_sent = 0.0                               # perf_counter of the last tokens_decoded event
        self.kv_group = kv_group                               # None: migrated requests are re-prefilled
        self.kv_sender = KVSender(kv_group) if kv_group is not None else None
        self.kv_receiver = KVReceiver(kv_group, engine.device) if kv_group is not None else None
        self.kv_incoming: dict[int, StartRequest] = {}         # req_id -> its Start, while its KV is on the way
        self.kv_out = KeptKV(engine)                           # req_id -> KV kept since its migrating Interrupt
        self.kv_adopted = self.kv_refused = 0                  # tokens of received KV imported as cached / not
        self.failures_isolated = failures_isolated             # engine failures survived (0: a failure ends the run)
        self.health = Health.OK
        self.failures = 0
        self.retired = False                                   # failed more often than isolated: never rejoins
        self.failed_at = self.down_until = 0.0                 # perf_counter of the failure; no rebuild before
        self.streamed: dict[int, int] = {}                     # req_id -> tokens the controller's pool holds
        self.kv_void: set[int] = set()                         # KV receives to complete and drop (sent pre-failure)

    @classmethod
    def for_rank(cls, cfg: Config, parts: RunParts, engine: LLMEngine, topo: Topology, channel: Channel, t0: float,
                 receiver: WeightReceiver | None, preset: Preset | None = None, **kw: Any) -> "RolloutWorker":
        """This rank's worker, as the run config says; what its counters carry and how often, as `preset`'s
        mechanisms read them (Preset.reads_progress, Preset.counters_period_s), and whether it isolates engine
        faults (Preset.failures_isolated; never in colocated mode, where the rank is a trainer shard too)."""
        r = cfg.rollout
        return cls(engine, channel, engine_index=topo.engine_of(topo.rank), rank=topo.rank, reward_fn=parts.reward_fn,
                   decode=response_decoder(parts.tokenizer, engine.eos_ids), receiver=receiver,
                   sampling=SamplingConfig(r.temperature, r.top_p, r.top_k, r.max_new_tokens, cfg.seed,
                                           ignore_eos=r.ignore_eos,
                                           report_progress=preset is not None and preset.reads_progress(),
                                           counters_every_s=preset.counters_period_s() if preset else None), t0=t0,
                   verify_weights=cfg.cluster.verify_weights,
                   scorer=reward_scorer(cfg, parts.reward_fn), kv_group=topo.kv_group if r.migrate_kv else None,
                   failures_isolated=preset.failures_isolated() if preset is not None and not topo.colocate else 0,
                   **kw)

    def now(self) -> float:
        return time.time() - self.t0

    def event(self, kind: str, **kw: Any) -> None:
        self.outbox.append(Event(kind, self.now(), rank=self.rank, engine=self.engine_index, **kw))

    def flush(self) -> None:
        if self.outbox:
            self.channel.send(self.outbox, 0)
            self.outbox = []

    # --------------------------------------------------------------------------------------------- messages
    def handle(self, msg: Any) -> bool:
        """Apply one message from the leader; False means stop. Any message but a Start or a SendKV first waits
        for the KV still coming, so what it acts on (an interrupt, abort, weight load, stop) finds every request it
        was sent in the engine."""
        if not isinstance(msg, (Start, SendKV, ReceiveWeights)):
            self._take_kv(wait=True)
        if isinstance(msg, (LoadWeights, Stop)):
            self._take_relay(wait=True)
        if self.health is not Health.OK and isinstance(msg, (Start, LoadWeights, ResetEngine)):
            self._while_failed(msg)
        elif isinstance(msg, ResetEngine):
            raise RuntimeError(f"rank {self.rank}: told its engine's requests were taken back, but it never failed")
        elif isinstance(msg, Start):
            for req in msg.requests:
                self._add(req)
        elif isinstance(msg, ReceiveWeights):
            if self.receiver is None:
                raise RuntimeError(f"rank {self.rank} told to receive weights but it has no publication group")
            self.notices[msg.version] = (time.perf_counter(), self.engine.num_tokens_decoded)
            self.publications.submit(msg.version, self._receive_publication, msg.version)
        elif isinstance(msg, LoadWeights):
            self.load(msg.version)
            self.kv_out.clear()   # computed by the weights just replaced
        elif isinstance(msg, SendKV):
            if self.kv_sender is None:
                raise RuntimeError(f"rank {self.rank} told to send KV but it has no KV group")
            self.kv_sender.send(self.kv_out.pop(msg.req_id, None), msg.req_id, msg.dst)
        elif isinstance(msg, Abort):
            for req_id in msg.req_ids:
                self.kv_out.pop(req_id, None)   # kept since its migrating Interrupt: dropped pending, not sent
                out = self.engine.abort(req_id)
                if out is not None:
                    self.answers.pop(req_id, None)
                    self.event("trajectory_aborted", req_id=req_id, group_id=out.group_id,
                               data={"requeue": msg.requeue, "tokens": len(out.token_ids)})
            self._maybe_idle()
        elif isinstance(msg, Interrupt):
            for req_id in msg.req_ids:
                self._interrupt(req_id, migrating=msg.dst >= 0)
            self._maybe_idle()
        elif isinstance(msg, Stop):
            return False
        else:
            raise TypeError(f"rank {self.rank}: unknown control message {type(msg).__name__}")
        return True

    # ------------------------------------------------------------------------------------------- engine faults
    def _while_failed(self, msg: Start | LoadWeights | ResetEngine) -> None:
        """A Start or LoadWeights the controller sent before it heard of the failure is void (it takes those
        requests back itself); a KV transfer such a Start announced is still received (its sender waits for it)
        and dropped. ResetEngine: from now on the controller knows, and the engine may rebuild."""
        if isinstance(msg, ResetEngine):
            self.health = Health.REBUILDING
            return
        if self.health is Health.REBUILDING:
            raise RuntimeError(f"rank {self.rank}: sent {type(msg).__name__} while its engine is failed and the "
                               f"controller knows it")
        if isinstance(msg, Start):
            for req in msg.requests:
                src = req.partial.meta.get("kv_rank") if req.partial is not None else None
                if src is not None and src != self.rank and self.kv_receiver is not None:
                    self.kv_receiver.receive(req.req_id, src)
                    self.kv_void.add(req.req_id)

    def _fail(self, err: Exception, finished: list[RequestOutput]) -> None:
        """Isolate a failed engine step (Laminar §3.3): drop everything the engine held (its state cannot be trusted
        after a failed step), report what it held (`engine_failed`; the controller resumes those requests from the
        partial-response pool) and take no work until the controller says it took them back (ResetEngine). Past
        `failures_isolated` failures the engine is retired."""
        held = {rid: s.num_generated for rid, s in self.engine.seqs.items()}
        held.update({o.request_id: len(o.token_ids) for o in finished})
        held.update({rid: len(req.partial.response_ids) for rid, req in self.kv_incoming.items()})
        self.kv_void.update(self.kv_incoming)
        self.kv_incoming.clear()
        self.engine.reset()
        for rid in held:
            self.answers.pop(rid, None)
        self.streamed.clear()
        self.kv_out.clear()
        self.failures += 1
        self.retired = self.failures > self.failures_isolated
        self.health = Health.FAILED
        self.failed_at = time.perf_counter()
        self.down_until = self.failed_at + getattr(err, "down_s", 0.0)
        error = f"{type(err).__name__}: {err}"
        print(f"rank {self.rank}: engine {self.engine_index} failed ({error}); {len(held)} requests taken back"
              + (", retired" if self.retired else ", rebuilding"), file=sys.stderr, flush=True)
        self.event("engine_failed", version=self.engine.version,
                   data={"error": error, "held": held, "permanent": self.retired, "failures": self.failures})
        self._maybe_idle()
        self.flush()

    def _rebuild(self) -> None:
        """Rebuild a failed engine and rejoin (`engine_recovered`): its pool is fresh (reset at the failure, and
        nothing entered it since: Starts are void until ResetEngine); weights that are not finite are reloaded from
        the relay. A rebuild that fails retires the engine (§3.3: the fault persists)."""
        if time.perf_counter() < self.down_until:
            return
        reloaded = False
        try:
            if not self.engine.weights_finite():
                self._take_relay(wait=True)
                if self.relay_version < 0:
                    raise RuntimeError("its weights are not finite and its relay holds none")
                self.engine.load_weights(self.relay.items(), self.relay_version)
                reloaded = True
                if not self.engine.weights_finite():
                    raise RuntimeError(f"the relay's weights (v{self.relay_version}) are not finite either")
        except Exception as err:
            self.retired = True
            self.event("engine_failed", version=self.engine.version,
                       data={"error": f"rebuild failed: {type(err).__name__}: {err}", "held": {}, "permanent": True,
                             "failures": self.failures})
            self.flush()
            return
        self.health = Health.OK
        self.event("engine_recovered", version=self.engine.version,
                   data={"down_s": time.perf_counter() - self.failed_at, "reloaded": reloaded})
        self.flush()

    def _partials(self) -> dict[int, tuple[int, list[int], list[float], list[int]]]:
        """Each request's tokens since the last stream, for the controller's partial-response pool (sched/partials.py):
        (start index, ids, behaviour log-probs, per-token versions)."""
        out, streamed = {}, {}
        for rid, s in self.engine.seqs.items():
            k, n = self.streamed.get(rid, 0), s.num_generated
            if n > k:
                out[rid] = (k, s.token_ids[s.num_prompt_tokens + k:], s.logprobs[k:], s.versions[k:])
            streamed[rid] = n
        self.streamed = streamed
        return out

    def load(self, version: int) -> None:
        """Adopt the relay's weights (the newest published, at least `version`) in the engine."""
        if version > self.relay_version:
            raise RuntimeError(f"rank {self.rank}: told to load version {version} but the relay holds "
                               f"{self.relay_version}")
        self.engine.load_weights(self.relay.items(), self.relay_version)
        if self.verify_weights:
            self.check_engine_weights()
        self.event("weights_loaded", version=self.relay_version)

    def _params(self, req: StartRequest) -> SamplingParams:
        """The request's sampling parameters, seeded per sample (the same on every engine and every resume)."""
        s = self.sampling
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0),
                              max_new_tokens=min(s.max_new_tokens, req.max_new_tokens or s.max_new_tokens),
                              seed=request_seed(s.seed, req.group_id, req.sample_index), ignore_eos=s.ignore_eos)

    def _add(self, req: StartRequest) -> None:
        """Queue one request: fresh, or resumed from its partial trajectory (`_resume`), at once or, when its KV is
        on another rank, once that KV is in (`_take_kv`): the source's send waits for this receive, which runs on
        the receiving thread while the engine keeps decoding."""
        part = req.partial
        if part is None:
            self.engine.add_request(GenRequest(req.prompt_ids, self._params(req), request_id=req.req_id,
                                               group_id=req.group_id, sample_index=req.sample_index,
                                               prompt_index=req.prompt_index))
            self.answers[req.req_id] = req.answer
            return
        src = part.meta.get("kv_rank")
        if src is None or src == self.rank:
            self._resume(req, self.kv_out.pop(req.req_id, None) if src == self.rank else None)
            return
        if self.kv_receiver is None:
            raise RuntimeError(f"rank {self.rank}: request {req.req_id} comes with KV on rank {src} but this rank "
                               f"has no KV group")
        self.kv_receiver.receive(req.req_id, src)
        self.kv_incoming[req.req_id] = req

    def _take_kv(self, wait: bool = False) -> None:
        """Resume the requests whose KV is in (`wait`: after waiting for every one still coming)."""
        if self.kv_incoming or self.kv_void:
            for req_id, kv in (self.kv_receiver.wait_all() if wait else self.kv_receiver.take()):
                if req_id in self.kv_void:   # announced before the engine failed: dropped
                    self.kv_void.discard(req_id)
                else:
                    self._resume(self.kv_incoming.pop(req_id), kv)

    def _resume(self, req: StartRequest, kv: KVState | None) -> None:
        """Queue a request resumed from its partial trajectory: its tokens so far are re-prefilled, or adopted as
        cached from `kv` when that was computed by this engine's weights. Its seed is the same and its draws are a
        function of (seed, token index), so the continuation is the one the first engine would have produced under
        the same weights; max_new_tokens counts the carried tokens too."""
        part = req.partial
        request = GenRequest(req.prompt_ids, self._params(req), request_id=req.req_id, group_id=req.group_id,
                             sample_index=req.sample_index, prompt_index=req.prompt_index)
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
            versions=versions, arrival_time=self.engine.clock(), kv=kv))
        if kv is not None:   # refused: computed by other weights, or no room now (re-prefilled instead)
            adopted = self.engine.seqs[req.req_id].num_cached_tokens > 0
            self.kv_adopted += kv.num_tokens * adopted
            self.kv_refused += kv.num_tokens * (not adopted)
        self.answers[req.req_id] = req.answer
        self.streamed[req.req_id] = len(ids)   # the controller's pool holds these already

    def _interrupt(self, req_id: int, migrating: bool = False) -> None:
        """Export one request the engine still holds and report its tokens so far (no event if not held); a
        migrating one's KV is kept for a SendKV."""
        if req_id not in self.engine.seqs:
            return
        u = self.engine.export(req_id, with_kv=migrating and self.kv_sender is not None)
        self.answers.pop(req_id, None)
        r = u.request
        meta: dict[str, Any] = {}
        data = {"tokens": len(u.token_ids)}
        if u.kv is not None:
            self.kv_out[req_id] = u.kv
            meta["kv_rank"], data["kv_tokens"] = self.rank, u.kv.num_tokens
        traj = Trajectory(group_id=r.group_id, sample_index=r.sample_index, prompt_ids=list(r.prompt_ids),
                          response_ids=list(u.token_ids), logprobs=list(u.logprobs), versions=list(u.versions),
                          finish_reason="interrupted", prompt_index=r.prompt_index, meta=meta)
        self.event("trajectory_interrupted", req_id=req_id, group_id=r.group_id, version=self.engine.version,
                   data=data, payload=traj)

    def _maybe_idle(self) -> None:
        """An engine emptied by aborts or interrupts is idle now, not at its next step (which may never come)."""
        if self.busy and not self.engine.has_unfinished():
            self.busy = False
            self.event("engine_idle", version=self.engine.version)

    def _receive_publication(self, version: int) -> tuple[int, dict[str, torch.Tensor], dict[str, int], float]:
        """On the relay's thread: one publication, whole (its version, tensors, checksums, seconds)."""
        t0 = time.perf_counter()
        got: list = []
        peers = self.receiver.peers
        with waiting(f"the publication of weights v{version} (from rank(s) {peers})", on=peers, phase=Phase.PUBLISH,
                     step=version):
            v = self.receiver.receive(lambda tensors, _: got.extend(self._relay_of(tensors)))
        return v, got[0], got[1], time.perf_counter() - t0

    def _take_relay(self, wait: bool = False) -> None:
        """Fill the relay with the publications received (`wait`: after waiting for those still arriving)."""
        if not self.publications.pending:
            return
        peers = self.receiver.peers if self.receiver is not None else [0]
        done = (self.publications.wait_all(f"the publication of weights v{self.publications.pending[-1]} "
                                           f"(from rank(s) {peers})", on=peers, phase=Phase.PUBLISH)
                if wait else self.publications.take())
        for announced, (version, relay, sums, seconds) in done:
            self.relay, self.relay_version, self.relay_sums = relay, version, sums
            t, tokens = self.notices.pop(announced)
            self.event("weights_received", version=version,
                       data={"seconds": seconds, "since_notice_s": time.perf_counter() - t,
                             "tokens_decoded": self.engine.num_tokens_decoded - tokens})

    def _relay_of(self, tensors) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """The received tensors themselves (views of buffers each publication allocates anew), on the CPU, and their
        checksums when verified: the receiver's, checked against the trainer's (else taken here)."""
        relay = {name: t.detach().to("cpu") for name, t in tensors}
        sums = {}
        if self.verify_weights:
            known = self.receiver.hashes if self.receiver is not None else {}
            sums = {n: known[n] if n in known else checksum(t) for n, t in relay.items()}
        return relay, sums

    def _into_relay(self, tensors, version: int) -> None:
        """Fill the relay at once (what a received publication does; tests use it to stage weights)."""
        self.relay, sums = self._relay_of(tensors)
        if self.verify_weights:
            self.relay_sums = sums

    def check_engine_weights(self) -> None:
        """The engine's tensors after a load equal the relay's (hence the trainer's) bit for bit, or the run stops
        naming the first tensor that differs."""
        params = self.engine.runner.model.state_dict()
        for name, want in self.relay_sums.items():
            got = checksum(params[name])
            if got != want:
                raise WeightMismatchError(f"rank {self.rank}: engine tensor {name} differs from the published "
                                          f"version {self.relay_version} after loading (checksum {got} != {want})")

    # ------------------------------------------------------------------------------------------------ stepping
    def step(self) -> None:
        with doing(f"engine step {self.steps + 1}", phase=Phase.DECODE, step=self.engine.version):
            self._step()

    def _step(self) -> None:
        if not self.busy:
            self.busy = True
            self.event("engine_busy", version=self.engine.version)
        finished: list[RequestOutput] = []
        before = self.steps
        try:
            finished = self.engine.step()
            self.steps += self.engine.last_step.steps   # several when the engine ran decode steps in one C call
            progress(f"{len(finished)} finished, {len(self.engine.seqs)} in the engine")
            injected = injected_engine_fault()   # runtime/faults.py `fail`
            if injected is not None:
                raise injected
            bad = [o.request_id for o in finished if o.finish_reason == "error"]
            if bad and self.failures_isolated:
                raise FloatingPointError(f"non-finite logits for request(s) {bad[:4]}: the engine's state is not "
                                         f"finite")
        except Exception as err:
            if not self.failures_isolated:
                raise
            self._fail(err, finished)
            return
        for out in finished:
            req_id = out.request_id
            answer = self.answers.pop(req_id)
            if out.finish_reason == "error":  # non-finite logits: dropped (never trained, never rescored), counted
                self.event("trajectory_aborted", req_id=req_id, group_id=out.group_id, version=out.version,
                           data={"requeue": False, "error": "non-finite logits", "tokens": len(out.token_ids)})
                continue
            traj = trajectory_of(out)
            text = self.decode(out.token_ids)
            self.event("trajectory_finished", req_id=req_id, group_id=out.group_id, version=out.version,
                       data={"tokens": len(out.token_ids), "finish_reason": out.finish_reason})
            if self.scorer is None:
                self._scored(req_id, out.version, traj, self.reward_fn(text, answer or ""))
                progress(f"scored request {req_id}")
            else:   # RollPacker §4.3: scored beside decoding, keyed by prompt (one test case per prompt)
                self.scoring[self.next_key] = (req_id, out.version, traj)
                self.scorer.submit(self.next_key, traj.prompt_index, text, answer or "")
                self.next_key += 1
        scored = self.collect_scores()
        period = self.sampling.counters_every_s
        idling = self.busy and not self.engine.has_unfinished()   # the last report of a busy span is its final state
        every = self.sampling.counters_every
        if idling or self.steps // every > before // every or (
                period is not None and time.perf_counter() - self.counters_sent >= period):
            self.counters_sent = time.perf_counter()
            st = self.engine.stats()
            self.event("tokens_decoded", version=st.version,
                       payload={"partials": self._partials()} if self.failures_isolated else None,
                       data={"total": st.num_tokens_decoded, "steps": self.steps, "running": len(st.running),
                             "waiting": len(st.waiting),
                             "kv_used": st.kv_blocks_used, "kv_free": st.kv_blocks_free,
                             "prefill": st.num_prefill_tokens, "kv_adopted": self.kv_adopted,
                             "kv_refused": self.kv_refused,
                             **({"progress": {rid: s.num_generated for rid, s in self.engine.seqs.items()}}
                                if self.sampling.report_progress else {})})
        self._maybe_idle()
        if finished or scored or not self.busy or self.failures_isolated:   # the pool is kept fresh
            self.flush()

    def _scored(self, req_id: int, version: int, traj: Trajectory, result: RewardResult) -> None:
        traj.reward, traj.correct = result.reward, result.correct
        traj.meta["reward_failed"] = result.failed
        self.event("reward_scored", req_id=req_id, group_id=traj.group_id, version=version,
                   data={"reward": result.reward, "correct": result.correct, "failed": result.failed},
                   payload=traj)

    def collect_scores(self) -> int:
        """reward_scored events for the asynchronous scores that are in (never blocks); how many."""
        if self.scorer is None or not self.scoring:
            return 0
        done = self.scorer.poll()
        for key, result, _ in done:
            req_id, version, traj = self.scoring.pop(key)
            self._scored(req_id, version, traj, result)
        if done:
            progress(f"{len(done)} scores in")
        return len(done)

    def close(self) -> None:
        """Send the scores already in; cancel the rest (never waits for a running verifier call); wait until the
        KV this rank was told to send is taken, and drop what it still keeps."""
        self.kv_out.clear()
        if self.kv_sender is not None:
            self.kv_sender.close()
        if self.kv_receiver is not None:
            self.kv_receiver.close()
        self._take_relay(wait=True)
        self.publications.close("the relay's thread", on=[0])
        if self.scorer is not None:
            self.collect_scores()
            self.scorer.close()
            self.scoring.clear()
        self.flush()

    SCORE_POLL_S = 0.005  # how long an idle loop waits for a message between looks at pending scores

    def run(self) -> None:
        with doing("the engine loop"):
            self._run()

    def _run(self) -> None:
        try:
            while True:
                self._take_kv()
                self._take_relay()
                msgs = self.channel.poll(WORKER)
                if self.health is Health.REBUILDING and not self.retired:
                    self._rebuild()
                if not msgs and not self.engine.has_unfinished():
                    if (self.scoring or self.kv_incoming or self.kv_void or self.publications.pending
                            or (self.health is Health.REBUILDING and not self.retired)):  # look again soon
                        self.collect_scores()
                        self.flush()
                        try:
                            msgs = [self.channel.get(WORKER, timeout=self.SCORE_POLL_S)]
                        except ChannelTimeout:
                            continue
                    else:
                        self.flush()
                        msgs = [self.channel.get(WORKER, waiting_for="work from the controller (rank 0)", on=[0])]
                for _, msg in msgs:
                    if not self.handle(msg):
                        self.close()
                        return
                    progress(f"handled {type(msg).__name__}")
                    self.flush()
                if self.engine.has_unfinished():
                    self.step()
        finally:
            if self.scorer is not None:
                self.scorer.close()


def response_decoder(tok: Any, eos_ids: frozenset[int]) -> Callable[[list[int]], str]:
    """Text the reward sees: the final EOS dropped, every other special token kept, so a policy cannot earn reward
    by padding with special tokens that a skip-special-tokens decode would hide."""
    def decode(ids: list[int]) -> str:
        return tok.decode(ids[:-1] if ids and ids[-1] in eos_ids else ids, skip_special_tokens=False)
    return decode

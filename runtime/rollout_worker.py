"""The rollout partition's worker loop: one decode engine per rollout rank, driven by control-channel messages.

    ("submit", [spec, ...])      add requests (prompt ids, group id, sample index, answer) to the engine; a spec
                                 with "partial" (response_ids, logprobs, versions, rng_state of an interrupted
                                 request) resumes it: prompt + tokens so far are re-prefilled and generation goes on
    ("interrupt", req_ids)       take running requests out of the engine and hand back their tokens so far
                                 (trajectory_interrupted, payload = the partial Trajectory); ids not held: ignored
    ("recv_weights", version)    join the publication broadcast; keep the weights in this rank's relay (CPU copy)
    ("load", version)            adopt the relay's weights in the engine (the weight-sync policy says when)
    ("abort", req_ids, requeue)  stop requests; report them aborted (requeued or dropped)
    ("stop",)                    leave the loop

Between messages the engine steps. Finished samples are scored beside the engine (as in the papers' disaggregated
setups) and sent back as events, batched one message per engine step:

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
  (sched/aborts.py). At "stop" the scores already in are sent and the rest are cancelled (the controller is done).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import GenRequest, RequestOutput, UnfinishedRequest
from rl.rewards import RewardResult
from rl.types import Trajectory
from runtime.channel import WORKER, Channel, ChannelTimeout
from runtime.reward_scorer import AsyncRewardScorer
from runtime.watchdog import maybe_kill, maybe_stall
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
    counters_every: int = 8  # send a tokens_decoded event every N engine steps


def request_seed(run_seed: int, group_id: int, sample_index: int) -> int:
    """Per-sample seed: a sample's tokens do not depend on batching, engine or timing (reproducible runs)."""
    return (run_seed * 1_000_003 + group_id * 9_973 + sample_index) % (2**63 - 1)


def trajectory_of(out: RequestOutput) -> Trajectory:
    """A finished engine output as a GRPO trajectory (engine timings in `meta`); reward not yet scored."""
    return Trajectory(
        group_id=out.group_id, sample_index=out.sample_index, prompt_ids=list(out.prompt_ids),
        response_ids=list(out.token_ids), logprobs=list(out.logprobs), versions=list(out.versions),
        finish_reason=out.finish_reason, prompt_index=out.prompt_index,
        meta=dict(request_id=out.request_id, arrival_time=out.arrival_time, first_token_time=out.first_token_time,
                  finish_time=out.finish_time, num_preemptions=out.num_preemptions))


class RolloutWorker:
    def __init__(self, engine: LLMEngine, channel: Channel, engine_index: int, rank: int,
                 reward_fn: Callable[[str, str], RewardResult], decode: Callable[[list[int]], str],
                 receiver: WeightReceiver | None, sampling: SamplingConfig, t0: float, timeout_s: float,
                 verify_weights: bool = False, scorer: AsyncRewardScorer | None = None):
        self.engine, self.channel, self.engine_index, self.rank = engine, channel, engine_index, rank
        self.reward_fn, self.decode, self.receiver, self.sampling = reward_fn, decode, receiver, sampling
        self.t0, self.timeout_s = t0, timeout_s
        self.answers: dict[str, tuple[int, str | None]] = {}   # engine request id -> (req_id, answer)
        self.relay: dict[str, torch.Tensor] = {}
        self.relay_version = -1
        self.relay_sums: dict[str, tuple[float, int]] = {}
        self.verify_weights = verify_weights
        self.scorer = scorer                                   # None: score inline in `step`
        self.scoring: dict[int, tuple[int, int, Trajectory]] = {}   # scorer key -> (req_id, version, trajectory)
        self.next_key = 0
        self.outbox: list[Event] = []
        self.busy = False
        self.steps = 0

    def now(self) -> float:
        return time.time() - self.t0

    def event(self, kind: str, **kw: Any) -> None:
        self.outbox.append(Event(kind, self.now(), rank=self.rank, engine=self.engine_index, **kw))

    def flush(self) -> None:
        if self.outbox:
            self.channel.send(self.outbox, 0)
            self.outbox = []

    # --------------------------------------------------------------------------------------------- messages
    def handle(self, msg: tuple) -> bool:
        """Apply one controller message; False means stop."""
        kind = msg[0]
        if kind == "submit":
            maybe_stall(self.rank)
            for spec in msg[1]:
                rid = self._add(spec)
                self.answers[rid] = (spec["req_id"], spec["answer"])
        elif kind == "recv_weights":
            if self.receiver is None:
                raise RuntimeError(f"rank {self.rank} told to receive weights but it has no publication group")
            self.relay_version = self.receiver.receive(self._into_relay)
        elif kind == "load":
            version = msg[1]
            if version > self.relay_version:
                raise RuntimeError(f"rank {self.rank}: told to load version {version} but the relay holds "
                                   f"{self.relay_version}")
            version = self.relay_version  # a newer publication reached the relay first: adopt it (pull latest)
            self.engine.load_weights(self.relay.items(), version)
            if self.verify_weights:
                self.check_engine_weights()
            self.event("weights_loaded", version=version)
        elif kind == "abort":
            _, req_ids, requeue = msg
            for req_id in req_ids:
                out = self.engine.abort(str(req_id))
                if out is not None:
                    self.answers.pop(out.request_id, None)
                    self.event("trajectory_aborted", req_id=req_id, group_id=out.group_id,
                               data={"requeue": bool(requeue), "tokens": len(out.token_ids)})
            self._maybe_idle()
        elif kind == "interrupt":
            for req_id in msg[1]:
                self._interrupt(req_id)
            self._maybe_idle()
        elif kind == "stop":
            return False
        else:
            raise ValueError(f"rank {self.rank}: unknown control message {kind!r}")
        return True

    def _params(self, spec: dict[str, Any]) -> SamplingParams:
        """The request's sampling parameters, seeded per sample (the same on every engine and every resume)."""
        s = self.sampling
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0),
                              max_new_tokens=min(s.max_new_tokens, spec.get("max_new_tokens") or s.max_new_tokens),
                              seed=request_seed(s.seed, spec["group_id"], spec["sample_index"]))

    def _add(self, spec: dict[str, Any]) -> str:
        """Queue one submitted request: fresh, or resumed from spec["partial"] (its tokens so far re-prefilled,
        its generator restored from rng_state, so a seeded continuation is the one the first engine would have
        produced under the same weights; max_new_tokens counts the carried tokens too)."""
        request = GenRequest(spec["prompt_ids"], self._params(spec), request_id=str(spec["req_id"]),
                                group_id=spec["group_id"], sample_index=spec["sample_index"],
                                prompt_index=spec["prompt_index"])
        part = spec.get("partial")
        if part is None:
            return self.engine.add_request(request)
        ids, lps, versions = list(part["response_ids"]), list(part["logprobs"]), list(part["versions"])
        if not len(ids) == len(lps) == len(versions):
            raise ValueError(f"rank {self.rank}: request {spec['req_id']} resumed with {len(ids)} tokens, "
                             f"{len(lps)} logprobs and {len(versions)} versions")
        if versions and max(versions) > self.engine.version:
            raise ValueError(f"rank {self.rank}: request {spec['req_id']} has tokens of version {max(versions)} "
                             f"but this engine holds version {self.engine.version} (tokens never go back)")
        # The sampled-distribution logprobs of earlier parts are not carried (nothing downstream reads them).
        return self.engine.import_request(UnfinishedRequest(
            request, token_ids=ids, logprobs=lps, sampling_logprobs=[float("nan")] * len(ids), versions=versions,
            arrival_time=self.engine.clock(), rng_state=part.get("rng_state")))

    def _interrupt(self, req_id: int) -> None:
        """Export one request the engine still holds and report its tokens so far (no event if not held)."""
        rid = str(req_id)
        if rid not in self.engine.seqs:
            return
        u = self.engine.export(rid)
        self.answers.pop(rid, None)
        r = u.request
        traj = Trajectory(group_id=r.group_id, sample_index=r.sample_index, prompt_ids=list(r.prompt_ids),
                          response_ids=list(u.token_ids), logprobs=list(u.logprobs), versions=list(u.versions),
                          finish_reason="interrupted", prompt_index=r.prompt_index,
                          meta={"rng_state": u.rng_state, "request_id": rid})
        self.event("trajectory_interrupted", req_id=req_id, group_id=r.group_id, version=self.engine.version,
                   data={"tokens": len(u.token_ids)}, payload=traj)

    def _maybe_idle(self) -> None:
        """An engine emptied by aborts or interrupts is idle now, not at its next step (which may never come)."""
        if self.busy and not self.engine.has_unfinished():
            self.busy = False
            self.event("engine_idle", version=self.engine.version)

    def _into_relay(self, tensors, version: int) -> None:
        self.relay = {name: t.detach().to("cpu", copy=True) for name, t in tensors}
        if self.verify_weights:  # the receiver already checked these against the trainer's checksums
            self.relay_sums = {name: checksum(t) for name, t in self.relay.items()}

    def check_engine_weights(self) -> None:
        """The engine's tensors after a load equal the relay's (hence the trainer's) bit for bit, or the run stops
        naming the first tensor that differs."""
        params = self.engine.runner.model.state_dict()
        for name, want in self.relay_sums.items():
            got = checksum(params[name])
            if got[1] != want[1]:
                raise WeightMismatchError(f"rank {self.rank}: engine tensor {name} differs from the published "
                                          f"version {self.relay_version} after loading (checksum {got} != {want})")

    # ------------------------------------------------------------------------------------------------ stepping
    def step(self) -> None:
        if not self.busy:
            self.busy = True
            self.event("engine_busy", version=self.engine.version)
        finished = self.engine.step()
        if finished:
            maybe_kill(self.engine.version)  # fault injection (runtime/watchdog.py)
        self.steps += 1
        for out in finished:
            req_id, answer = self.answers.pop(out.request_id)
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
            else:   # RollPacker §4.3: scored beside decoding, keyed by prompt (one test case per prompt)
                self.scoring[self.next_key] = (req_id, out.version, traj)
                self.scorer.submit(self.next_key, traj.prompt_index, text, answer or "")
                self.next_key += 1
        scored = self.collect_scores()
        if self.steps % self.sampling.counters_every == 0:
            snap = self.engine.stats()
            self.event("tokens_decoded", version=snap.version,
                       data={"total": snap.num_tokens_decoded, "running": len(snap.running),
                             "waiting": len(snap.waiting), "kv_used": snap.kv_blocks_used,
                             "kv_free": snap.kv_blocks_free})
        self._maybe_idle()
        if finished or scored or not self.busy:
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
        return len(done)

    def close(self) -> None:
        """Send the scores already in; cancel the rest (never waits for a running verifier call)."""
        if self.scorer is not None:
            self.collect_scores()
            self.scorer.close()
            self.scoring.clear()
        self.flush()

    SCORE_POLL_S = 0.005  # how long an idle loop waits for a message between looks at pending scores

    def run(self) -> None:
        try:
            while True:
                msgs = self.channel.poll(WORKER)
                if not msgs and not self.engine.has_unfinished():
                    if self.scoring:  # scores pending: send those in, then wait briefly (never block on the channel)
                        self.collect_scores()
                        self.flush()
                        try:
                            msgs = [self.channel.get(timeout=self.SCORE_POLL_S, port=WORKER)]
                        except ChannelTimeout:
                            continue
                    else:
                        self.flush()
                        msgs = [self.channel.get(timeout=self.timeout_s, port=WORKER,
                                                 waiting_for="work from the controller (rank 0)")]
                for _, msg in msgs:
                    if not self.handle(msg):
                        self.close()
                        return
                    self.flush()
                if self.engine.has_unfinished():
                    self.step()
        finally:
            if self.scorer is not None:
                self.scorer.close()

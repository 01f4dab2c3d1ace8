"""The rollout partition's worker loop: one decode engine per rollout rank, driven by the leader's messages
(runtime/messages.py; the worker dispatches on their type):

    Start            add requests (prompt ids, group id, sample index, answer) to the engine; a request with a
                     `partial` trajectory resumes: prompt + tokens so far are re-prefilled, or its KV is adopted
                     (received first when the partial is tagged with another rank: runtime/kv_migration.py)
    Interrupt        take running requests out of the engine and hand back their tokens so far
                     (trajectory_interrupted, payload = the partial Trajectory); ids not held: ignored. A migration's
                     (`dst` set) keeps the request's KV aside here and tags the partial with this rank (`kv_rank`)
    SendKV           send a kept KV to the rank about to resume that request (runtime/kv_migration.py)
    ReceiveWeights   join the publication broadcast on the relay's thread while the engine decodes on
                     (runtime/relay.py; `weights_received` once it is in)
    LoadWeights      adopt the relay's weights in the engine (the weight-sync policy says when): the newest
                     publication, at least the version asked for (`weights_loaded` says which); running sequences
                     are recomputed under it, or keep their KV where the decision says `keep_kv`; kept KV is dropped
    Abort            stop requests; report them aborted (requeued or dropped); drop the KV kept for one
                     (no event: it was not in the engine)
    Stop             leave the loop
    ResetEngine      (after this rank reported `engine_failed`) the controller took the engine's requests back: the
                     engine may rebuild and rejoin (runtime/engine_health.py: fault isolation, Laminar §3.3)

Multi-turn episodes (an `Environment`, rl/env.py; runtime/episodes.py): a request's turn that stops is held by the
engine; its text goes to the environment, whose tool call runs on this rank's tool pool beside decoding
(`tool_started`, then `tool_finished` when it returns or times out) and whose observation extends the request, its
KV kept. The episode's one `trajectory_finished` comes at its end, its trajectory carrying the loss mask; the reward
scores its last model turn. An interrupted, aborted or migrated request (or one on a failed engine) waiting on a tool
abandons the call; resumed, it continues from its transcript.

Request ids are the controller's int `req_id` end to end, the engine's request id included. Between messages the
engine steps; events go out batched, one message per engine step. Each finished sample goes to the scorer
(runtime/reward_scorer.py: inline, the default, or asynchronous, RollPacker §4.3) as its `trajectory_finished` goes
out, and each score that is in becomes a `reward_scored` event. While scores are pending the loop polls the control
channel instead of blocking on it; they keep no engine busy (`engine_idle` means "nothing decoding"). An abort or
interrupt of a request already finished does nothing here: its one `reward_scored` still comes, and the controller
discards it if it dropped the request (sched/lifecycle.py). At Stop the scores already in are sent, the rest
cancelled.

Deadlines (runtime/watchdog.py): the wait for the next message and a publication's broadcast are waits on the
leader; every engine step, scored sample and handled message is progress, which renews the waits of the ranks
waiting on this one (the controller, for events).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from config import Config
from engine.engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import GenRequest, KVState, RequestOutput
from rl.env import Environment
from rl.episode import stop_token_ids
from rl.rewards import RewardResult
from rl.types import Trajectory
from runtime.build import RunParts, environment, reward_scorer
from runtime.channel import WORKER, Channel, ChannelTimeout
from runtime.engine_health import EngineHealth
from runtime.episodes import Episodes, count_turns, last_turn
from runtime.kv_migration import KVMigration
from runtime.messages import ReceiveWeights, SendKV, Start, StartRequest, Stop
from runtime.relay import Relay
from runtime.reward_scorer import RewardScorer
from runtime.samples import observation_encoder, partial_of, request_seed, response_decoder, trajectory_of
from runtime.topology import Topology
from runtime.watchdog import Phase, doing, progress
from sched.base import Preset
from sched.decisions import Abort, Interrupt, LoadWeights, ResetEngine
from sched.events import Event
from trainer.publish import WeightReceiver


@dataclass
class SamplingConfig:
    """The rank's sampling parameters (each request's seed is its own: runtime/samples.py) and how often its
    counters go out."""
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int
    counters_every: int = 8  # send a tokens_decoded event every N engine steps, and at the step that empties it
    ignore_eos: bool = False
    report_progress: bool = False   # counters carry each request's tokens so far (Preset.reads_progress)
    counters_every_s: float | None = None   # and a busy engine sends them at least this often (Preset)


class RolloutWorker:
    """One rollout rank's engine loop: dispatches the leader's messages, steps the engine between them, and sends
    the events back; its relay, KV migration, fault isolation and scorer are the collaborators of the module
    docstring."""

    def __init__(self, engine: LLMEngine, channel: Channel, *, engine_index: int, rank: int,
                 scorer: RewardScorer, decode: Callable[[list[int]], str], receiver: WeightReceiver | None,
                 sampling: SamplingConfig, t0: float, verify_weights: bool = False,
                 kv_group: dist.ProcessGroup | None = None, failures_isolated: int = 0,
                 env: Environment | None = None, encode: Callable[[str], list[int]] | None = None,
                 turn_stops: tuple[int, ...] = (), tool_workers: int = 4, tool_lockstep: bool = False):
        self.engine, self.channel, self.engine_index, self.rank = engine, channel, engine_index, rank
        self.scorer, self.decode, self.sampling, self.t0 = scorer, decode, sampling, t0
        self.answers: dict[int, str | None] = {}               # req_id -> its reference answer
        self.outbox: list[Event] = []
        self.busy = False
        self.steps = 0
        self.counters_sent = 0.0                               # perf_counter of the last tokens_decoded event
        self.relay = Relay(engine, receiver, rank=rank, verify=verify_weights, event=self.event)
        self.kv = KVMigration(engine, kv_group, rank=rank)     # kv_group None: migrated requests are re-prefilled
        self.health = EngineHealth(engine, self.relay, self.kv, rank=rank, engine_index=engine_index,
                                   isolated=failures_isolated, event=self.event, flush=self.flush)
        # multi-turn episodes: `turn_stops` end a turn besides EOS (rl/episode.py stop_token_ids: plain's "=")
        self.episodes: Episodes | None = None
        self.turn_stops = tuple(turn_stops)
        if env is not None:
            if encode is None:
                raise ValueError("a multi-turn worker needs the tokenizer's encode for observations")
            self.episodes = Episodes(env, engine, encode=encode, decode=decode, event=self.event,
                                     tool_workers=tool_workers, lockstep=tool_lockstep)

    @classmethod
    def for_rank(cls, cfg: Config, parts: RunParts, engine: LLMEngine, topo: Topology, channel: Channel, t0: float,
                 receiver: WeightReceiver | None, preset: Preset | None = None, **kw: Any) -> "RolloutWorker":
        """This rank's worker, as the run config says; what its counters carry and how often, as `preset`'s
        mechanisms read them (Preset.reads_progress, Preset.counters_period_s), whether it isolates engine
        faults (Preset.failures_isolated; never in colocated mode, where the rank is a trainer shard too), and its
        environment (`[env]`; None, single-turn, for `env.kind = "none"`)."""
        r, env = cfg.rollout, environment(cfg)
        return cls(engine, channel, engine_index=topo.engine_of(topo.rank), rank=topo.rank,
                   scorer=reward_scorer(cfg, parts.reward_fn), decode=response_decoder(parts.tokenizer, engine.eos_ids),
                   receiver=receiver,
                   sampling=SamplingConfig(r.temperature, r.top_p, r.top_k, r.max_new_tokens, cfg.seed,
                                           ignore_eos=cfg.perf.ignore_eos,
                                           report_progress=preset is not None and preset.reads_progress(),
                                           counters_every_s=preset.counters_period_s() if preset else None), t0=t0,
                   verify_weights=cfg.cluster.verify_weights, kv_group=topo.kv_group if cfg.perf.migrate_kv else None,
                   failures_isolated=preset.failures_isolated() if preset is not None and not topo.colocate else 0,
                   env=env, encode=observation_encoder(parts.tokenizer),
                   turn_stops=stop_token_ids(env, parts.tokenizer) if env is not None else (),
                   tool_workers=cfg.env.tool_workers, tool_lockstep=cfg.deterministic, **kw)

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
            self.relay.take(wait=True)
        if not self.health.ok and isinstance(msg, (Start, LoadWeights, ResetEngine)):
            self.health.void(msg)
        elif isinstance(msg, ResetEngine):
            raise RuntimeError(f"rank {self.rank}: told its engine's requests were taken back, but it never failed")
        elif isinstance(msg, Start):
            for req in msg.requests:
                self._add(req)
        elif isinstance(msg, ReceiveWeights):
            self.relay.announce(msg.version)
        elif isinstance(msg, LoadWeights):
            self.relay.load(msg.version, keep_kv=msg.keep_kv)
            self.kv.out.clear()   # computed by the weights just replaced
        elif isinstance(msg, SendKV):
            self.kv.send(msg.req_id, msg.dst)
        elif isinstance(msg, Abort):
            for req_id in msg.req_ids:
                self.kv.out.pop(req_id, None)   # kept since its migrating Interrupt: dropped pending, not sent
                out = self.engine.abort(req_id)
                if out is not None:
                    self._forget(req_id)
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

    def _params(self, req: StartRequest) -> SamplingParams:
        """The request's sampling parameters, seeded per sample (the same on every engine and every resume)."""
        s = self.sampling
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0),
                              max_new_tokens=min(s.max_new_tokens, req.max_new_tokens or s.max_new_tokens),
                              seed=request_seed(s.seed, req.group_id, req.sample_index), ignore_eos=s.ignore_eos,
                              stop_token_ids=self.turn_stops if self.episodes is not None else ())

    def _add(self, req: StartRequest) -> None:
        """Queue one request: fresh, or resumed from its partial trajectory, at once or, when its KV is on another
        rank, once that KV is in (`_take_kv`): the source's send waits for this receive, which runs on the receiving
        thread while the engine keeps decoding."""
        part = req.partial
        if part is None:
            self.engine.add_request(GenRequest(req.prompt_ids, self._params(req), request_id=req.req_id,
                                               group_id=req.group_id, sample_index=req.sample_index,
                                               prompt_index=req.prompt_index,
                                               multi_turn=self.episodes is not None))
            self.answers[req.req_id] = req.answer
            return
        src = part.meta.get("kv_rank")
        if src is None or src == self.rank:
            self._resume(req, self.kv.out.pop(req.req_id, None) if src == self.rank else None)
        else:
            self.kv.expect(req, src)

    def _take_kv(self, wait: bool = False) -> None:
        """Resume the requests whose KV is in (`wait`: after waiting for every one still coming)."""
        for req, kv in self.kv.take(wait):
            self._resume(req, kv)

    def _resume(self, req: StartRequest, kv: KVState | None) -> None:
        """Queue a request from its partial trajectory (runtime/kv_migration.py), with the KV it comes with. A
        multi-turn one whose last turn had ended comes back held, that turn acted on again."""
        part = req.partial
        held = self.episodes is not None and self._turn_over(part.response_ids, part.loss_mask)
        self.kv.resume(req, self._params(req), kv, multi_turn=self.episodes is not None, held=held)
        self.answers[req.req_id] = req.answer
        self.health.streamed[req.req_id] = len(part.response_ids)   # the controller's pool holds these
        if self.episodes is None:
            return
        if not held:
            self.episodes.resumed(req.req_id, part.meta)
        elif (out := self.episodes.resume_held(req.req_id, part.meta)) is not None:
            self._finished(out)

    def _turn_over(self, ids: list[int], mask: list[int] | None) -> bool:
        """A transcript whose last model turn had stopped (and had no observation yet): it waited on a tool."""
        return bool(ids) and (mask is None or mask[-1] == 1) and (
            ids[-1] in self.turn_stops or (ids[-1] in self.engine.eos_ids and not self.sampling.ignore_eos))

    def _interrupt(self, req_id: int, migrating: bool = False) -> None:
        """Export one request the engine still holds and report its tokens so far (no event if not held); a
        migrating one's KV is kept for a SendKV."""
        if req_id not in self.engine.seqs:
            return
        u = self.engine.export(req_id, with_kv=migrating and self.kv.keeps_kv)
        meta: dict[str, Any] = self._forget(req_id)
        data = {"tokens": len(u.token_ids)}
        if u.kv is not None:
            self.kv.out[req_id] = u.kv
            meta["kv_rank"], data["kv_tokens"] = self.rank, u.kv.num_tokens
        self.event("trajectory_interrupted", req_id=req_id, group_id=u.request.group_id, version=self.engine.version,
                   data=data, payload=partial_of(u, meta))

    def _forget(self, req_id: int) -> dict[str, Any]:
        """A request left this engine unfinished: its answer dropped, its tool call in flight abandoned. Returns its
        episode's counters (for a partial trajectory's meta; empty when single-turn)."""
        self.answers.pop(req_id, None)
        if self.episodes is None:
            return {}
        self.episodes.abandon(req_id)
        return self.episodes.meta(req_id)

    def _maybe_idle(self) -> None:
        """An engine emptied by aborts or interrupts is idle now, not at its next step (which may never come)."""
        if self.busy and not self.engine.has_unfinished():
            self.busy = False
            self.event("engine_idle", version=self.engine.version)

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
            self.steps += self.engine.last_step.steps   # a CPU engine may run several a call (perf.cpu_decode_steps)
            progress(f"{len(finished)} finished, {len(self.engine.seqs)} in the engine")
            self.health.check(finished)
        except Exception as err:
            if not self.health.isolated:
                raise
            for req_id in self.health.fail(err, finished):
                self._forget(req_id)
            self._maybe_idle()
            self.flush()
            return
        if self.episodes is not None:
            finished = self._turns(finished)
        scored = sum(self._finished(out) for out in finished) + self.collect_scores()
        self._counters(before)
        self._maybe_idle()
        if finished or scored or not self.busy or self.health.isolated:   # the pool is kept fresh
            self.flush()

    def _turns(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """The step's outputs, each held one (a turn that ended) handed to its episode: a tool call starts, or the
        episode is over (its final output kept)."""
        done = []
        for out in outs:
            if out.held:
                out = self.episodes.turn_ended(out)   # type: ignore[union-attr]
            if out is not None:
                done.append(out)
        return done

    def _tools(self) -> None:
        """The tool calls that returned or timed out: their observations appended (the requests decode on), the
        episodes they ended reported."""
        if self.episodes is None or not self.episodes.pending:
            return
        ended = self.episodes.poll()
        for out in ended:
            self._finished(out)
        if self.outbox:
            progress(f"{len(ended)} episodes ended by tool results")
            self.flush()

    def _finished(self, out: RequestOutput) -> int:
        """Report one finished request and hand it to the scorer; the scores that are in at once (inline). An
        episode's reward scores its last model turn; one its environment broke (finish_reason "error") scores 0."""
        req_id = out.request_id
        answer = self.answers.pop(req_id)
        env_error = self.episodes is not None and req_id in self.episodes.errors
        if out.finish_reason == "error" and not env_error:  # non-finite logits: dropped (never trained), counted
            if self.episodes is not None:
                self.episodes.meta(req_id)
            self.event("trajectory_aborted", req_id=req_id, group_id=out.group_id, version=out.version,
                       data={"requeue": False, "error": "non-finite logits", "tokens": len(out.token_ids)})
            return 0
        traj = trajectory_of(out)
        text_ids = out.token_ids
        if self.episodes is not None:
            traj.meta.update(self.episodes.meta(req_id), turns=count_turns(out.token_ids, out.mask))
            text_ids = last_turn(out.token_ids, out.mask)   # rl/episode.py `reward_text`
        self.event("trajectory_finished", req_id=req_id, group_id=out.group_id, version=out.version,
                   data={"tokens": len(out.token_ids), "finish_reason": out.finish_reason})
        if env_error:
            self._scored(req_id, out.version, traj, RewardResult(0.0, False, reason=traj.meta["env_error"]))
            return 1 + self.collect_scores()
        # the key comes back with the score; the test case is the prompt (RollPacker §4.3's adaptive timeout)
        self.scorer.submit((req_id, out.version, traj), traj.prompt_index, self.decode(text_ids), answer or "")
        return self.collect_scores()

    def _counters(self, before: int) -> None:
        """`tokens_decoded` every `counters_every` engine steps, every `counters_every_s` seconds when set, and at
        the step that empties a busy engine (the last report of a busy span is its final state)."""
        period, every = self.sampling.counters_every_s, self.sampling.counters_every
        idling = self.busy and not self.engine.has_unfinished()
        if not (idling or self.steps // every > before // every or (
                period is not None and time.perf_counter() - self.counters_sent >= period)):
            return
        self.counters_sent = time.perf_counter()
        st = self.engine.stats()
        self.event("tokens_decoded", version=st.version,
                   payload={"partials": self.health.partials()} if self.health.isolated else None,
                   data={"total": st.num_tokens_decoded, "steps": self.steps, "running": len(st.running),
                         "waiting": len(st.waiting), "kv_used": st.kv_blocks_used, "kv_free": st.kv_blocks_free,
                         "preemptions": st.num_preemptions,
                         "prefill": st.num_prefill_tokens, "kv_adopted": self.kv.adopted, "kv_refused": self.kv.refused,
                         **({"progress": {rid: s.num_generated for rid, s in self.engine.seqs.items()}}
                            if self.sampling.report_progress else {})})

    def collect_scores(self) -> int:
        """reward_scored events for the scores that are in (never blocks); how many."""
        if not len(self.scorer):
            return 0
        done = self.scorer.poll()
        for (req_id, version, traj), result, _ in done:
            self._scored(req_id, version, traj, result)
        if done:
            progress(f"scored request {req_id}" if len(done) == 1 else f"{len(done)} scores in")
        return len(done)

    def _scored(self, req_id: int, version: int, traj: Trajectory, result: RewardResult) -> None:
        traj.reward, traj.correct = result.reward, result.correct
        traj.meta["reward_failed"] = result.failed
        self.event("reward_scored", req_id=req_id, group_id=traj.group_id, version=version,
                   data={"reward": result.reward, "correct": result.correct, "failed": result.failed},
                   payload=traj)

    # ------------------------------------------------------------------------------------------------ the loop
    def close(self) -> None:
        """Send the scores already in; cancel the rest (never waits for a running verifier call); wait until the
        KV this rank was told to send is taken, and drop what it still keeps."""
        self.kv.close()
        self.relay.close()
        if self.episodes is not None:
            self.episodes.close()
        self.collect_scores()
        self.scorer.close()
        self.flush()

    SCORE_POLL_S = 0.005  # how long an idle loop waits for a message between looks at pending scores

    def run(self) -> None:
        with doing("the engine loop"):
            self._run()

    def _run(self) -> None:
        try:
            while True:
                self._take_kv()
                self.relay.take()
                self._tools()
                msgs = self.channel.poll(WORKER)
                if self.health.rebuild_due:
                    self.health.rebuild()
                if not msgs and not self.engine.has_unfinished():
                    if (len(self.scorer) or self.kv.pending or self.relay.publications.pending
                            or self.health.rebuild_due or (self.episodes is not None and self.episodes.pending)):
                        # look again soon
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
            self.scorer.close()
            if self.episodes is not None:
                self.episodes.close()


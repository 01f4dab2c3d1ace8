"""The rollout worker without a cluster: messages in, events out, weight verification after a load, interrupt and
resume of partial trajectories (and the backend's side of both)."""
import dataclasses
import queue
import threading
import time

import pytest
import torch

from engine import GenRequest, SamplingParams
from model import cu_seqlens_from_lengths
from rl.rewards import RewardResult
from rl.types import Trajectory
from runtime.backend import RuntimeBackend
from runtime.channel import ChannelTimeout
from runtime.messages import ReceiveWeights, Start, StartRequest, Stop
from runtime.relay import WeightMismatchError
from runtime.reward_scorer import InlineScorer
from runtime.samples import trajectory_of
from runtime.topology import Topology
from sched.controller import PromptItem
from sched.decisions import Abort, Interrupt, LoadWeights, Migrate
from sched.events import Event
from sched.views import Request as SchedRequest
from tests.support.worker import FakeChannel, events_of, group_specs, loaded_worker, make_worker, published, run_to_end


pytestmark = pytest.mark.usefixtures("one_thread")


def test_trajectory_of_an_engine_output():
    w, _, task, tok = make_worker()
    prompt = tok.encode(task.prompts()[0][0], add_special_tokens=False)
    out = w.engine.generate([GenRequest(prompt, SamplingParams(max_new_tokens=4, seed=1), group_id=2, sample_index=3,
                                     prompt_index=11)])[0]
    t = trajectory_of(out)
    assert (t.group_id, t.sample_index, t.prompt_index, t.prompt_ids) == (2, 3, 11, out.prompt_ids)
    assert t.response_ids == out.token_ids and t.logprobs == out.logprobs and t.versions == out.versions
    assert t.version == -1 and t.finish_reason == out.finish_reason and t.reward is None
    assert t.meta["first_token_time"] >= t.meta["arrival_time"]


def test_submit_steps_and_reports_scored_trajectories():
    w, ch, task, tok = make_worker()
    w.relay.fill(published(w.engine, 1.5), 0)
    assert w.handle(LoadWeights(0, 0))
    prompts = task.prompts()[:2]
    specs = [StartRequest(10 * g + s, g, s, g, tok.encode(p, add_special_tokens=False), a)
             for g, (p, a) in enumerate(prompts) for s in range(3)]
    w.handle(Start(specs))
    while w.engine.has_unfinished():
        w.step()
    events = [e for _, batch in ch.sent for e in batch]
    scored = [e for e in events if e.kind == "reward_scored"]
    assert sorted(e.req_id for e in scored) == sorted(s.req_id for s in specs)
    answer = {s.req_id: s.answer for s in specs}
    eos = tok.eos_token_id
    for e in scored:
        t = e.payload
        assert t.versions and set(t.versions) == {0} and len(t.logprobs) == len(t.response_ids)
        ids = t.response_ids[:-1] if t.response_ids and t.response_ids[-1] == eos else t.response_ids
        want = task.score(tok.decode(ids, skip_special_tokens=False), answer[e.req_id])
        assert (t.reward, t.correct) == (want.reward, want.correct) == (e.data["reward"], e.data["correct"])
    kinds = [e.kind for e in events]
    assert kinds[0] == "weights_loaded" and "engine_busy" in kinds and kinds[-1] == "engine_idle"
    assert w.engine.block_manager.num_free == w.engine.block_manager.num_blocks
    # inline scoring (reward.async_workers = 0): each score right behind its trajectory_finished, in one message
    for batch in (b for _, b in ch.sent):
        for i, e in enumerate(batch):
            if e.kind == "trajectory_finished":
                assert batch[i + 1].kind == "reward_scored" and batch[i + 1].req_id == e.req_id
    assert isinstance(w.scorer, InlineScorer) and not len(w.scorer)


def test_a_load_that_corrupts_a_tensor_is_named():
    w, ch, _, _ = make_worker()
    w.relay.fill(published(w.engine, 2.0), 3)
    original = w.engine.runner.load_weights

    def corrupting(weights):
        n = original(weights)
        with torch.no_grad():
            w.engine.runner.model.model.layers[1].mlp.up_proj.weight[0, 0] += 1e-3
        return n
    w.engine.runner.load_weights = corrupting
    with pytest.raises(WeightMismatchError, match="model.layers.1.mlp.up_proj.weight"):
        w.handle(LoadWeights(0, 3))


def test_loading_a_version_the_relay_does_not_hold_fails():
    w, _, _, _ = make_worker()
    with pytest.raises(RuntimeError, match="relay holds"):
        w.handle(LoadWeights(0, 5))


def training_logprobs(model, prompt, response, temperature=1.0):
    seq = prompt + response
    with torch.no_grad():
        logits = model.forward_packed(torch.tensor(seq), cu_seqlens_from_lengths([len(seq)]))
    rows = torch.arange(len(prompt) - 1, len(seq) - 1)
    return torch.log_softmax(logits.float() / temperature, -1)[rows, torch.tensor(response)]


def test_interrupt_hands_back_partials_and_another_worker_finishes_them_as_if_uninterrupted():
    ref, ref_ch, task, tok = loaded_worker(max_new_tokens=12)
    specs = group_specs(task, tok)
    ref.handle(Start(specs))
    run_to_end(ref)
    want = {e.req_id: e.payload for e in events_of(ref_ch, "reward_scored")}

    a, a_ch, _, _ = loaded_worker(max_new_tokens=12)
    a.handle(Start(specs))
    for _ in range(4):
        a.step()
    running = {int(r) for r in a.engine.seqs}
    assert len(running) >= 4  # most are mid-generation (a seeded run: fixed)
    a.handle(Interrupt(0, sorted(running) + [999]))   # 999: never held, ignored
    a.flush()
    interrupted = events_of(a_ch, "trajectory_interrupted")
    assert sorted(e.req_id for e in interrupted) == sorted(running)
    assert not a.answers and not a.engine.has_unfinished()
    assert a.engine.block_manager.num_free == a.engine.block_manager.num_blocks
    assert events_of(a_ch, "engine_idle")  # emptied by the interrupt: idle now, not at a next step
    spec_of = {s.req_id: s for s in specs}
    for e in interrupted:
        t = e.payload
        n = len(t.response_ids)
        assert e.version == 0 and e.data == {"tokens": n} and e.group_id == spec_of[e.req_id].group_id
        assert 0 < n < 12 and t.finish_reason == "interrupted" and t.reward is None
        assert len(t.logprobs) == n and t.versions == [0] * n and t.prompt_ids == spec_of[e.req_id].prompt_ids
        assert t.response_ids == want[e.req_id].response_ids[:n]

    # resume on a second worker: specs as the backend builds them from the controller's Request.partial
    b, b_ch, _, _ = loaded_worker(max_new_tokens=12)
    prompt_items = {s.group_id: PromptItem(s.prompt_index, s.prompt_ids, s.answer) for s in specs}
    reqs = []
    for e in interrupted:
        s = spec_of[e.req_id]
        reqs.append(SchedRequest(req_id=e.req_id, group_id=s.group_id, sample_index=s.sample_index,
                                 prompt_index=s.prompt_index, round=0, prompt_len=len(s.prompt_ids),
                                 partial=e.payload))
    sent = FakeChannel()
    topo = Topology(rank=0, world=2, train_ranks=[0], rollout_ranks=[1], colocate=False,
                    device=torch.device("cpu"))
    RuntimeBackend(topo, sent, t0=0.0, to_trainer=None).submit(0, reqs, prompt_items)
    (_, start), = sent.sent
    assert all(sr.partial is e.payload for sr, e in zip(start.requests, interrupted))
    b.handle(start)
    assert set(b.answers) == {r.req_id for r in reqs}
    run_to_end(b)
    got = {e.req_id: e for e in events_of(b_ch, "reward_scored")}
    assert sorted(got) == sorted(running) and not b.answers
    parts = {e.req_id: e.payload for e in interrupted}
    for rid, e in got.items():
        t, w0 = e.payload, want[rid]
        n = len(parts[rid].response_ids)
        assert t.response_ids[:n] == parts[rid].response_ids and t.logprobs[:n] == parts[rid].logprobs
        assert t.response_ids == w0.response_ids and t.versions == w0.versions
        assert torch.allclose(torch.tensor(t.logprobs), torch.tensor(w0.logprobs), atol=1e-5)
        assert (t.reward, t.correct) == (w0.reward, w0.correct)


def test_a_partial_from_a_newer_version_than_the_engine_is_refused():
    w, _, task, tok = loaded_worker()
    spec = dataclasses.replace(group_specs(task, tok, 1, 1)[0],
                               partial=Trajectory(0, 0, [1], [5], [-1.0], [3], "interrupted"))
    with pytest.raises(ValueError, match="version 3"):
        w.handle(Start([spec]))
    spec.partial.versions = [0, 0]
    with pytest.raises(ValueError, match="1 tokens, 1 logprobs and 2 versions"):
        w.handle(Start([spec]))


def test_load_on_a_busy_worker_keeps_running_sequences_under_the_new_version():
    w, ch, task, tok = loaded_worker(max_new_tokens=10)
    specs = group_specs(task, tok)
    w.handle(Start(specs))
    for _ in range(3):
        w.step()
    running = {int(r) for r in w.engine.seqs}
    assert running
    w.relay.fill(published(w.engine, 1.3), 1)  # version 1: the engine's weights scaled
    w.handle(LoadWeights(0, 1))
    assert w.engine.version == 1 and {int(r) for r in w.engine.seqs} == running  # nothing dropped
    run_to_end(w)
    scored = {e.req_id: e for e in events_of(ch, "reward_scored")}
    assert sorted(scored) == sorted(s.req_id for s in specs)
    model = w.engine.runner.model
    prompt_of = {s.req_id: s.prompt_ids for s in specs}
    for rid in running:
        t = scored[rid].payload
        k = t.versions.count(0)
        assert 0 < k < len(t.versions) and t.versions == [0] * k + [1] * (len(t.versions) - k)
        assert scored[rid].version == 0  # a trajectory's version is its oldest token's
        ref = training_logprobs(model, prompt_of[rid], t.response_ids)
        assert (torch.tensor(t.logprobs[k:]) - ref[k:]).abs().max() < 1e-4  # new tokens: the new weights
        assert (torch.tensor(t.logprobs[:k]) - ref[:k]).abs().max() > 1e-3  # old ones kept the old weights'


def test_a_keep_kv_load_on_a_busy_worker_goes_on_decoding_on_the_old_kv():
    """LoadWeights(keep_kv=True) (PipelineRL's in-flight update) reaches the engine through the relay: nothing is
    preempted (so none re-prefilled), the new tokens carry the new version, and they attended to the old weights' KV
    (their logprobs are not the new weights' over the whole context, as they are after the recomputing load above)."""
    w, ch, task, tok = loaded_worker(max_new_tokens=10)
    specs = group_specs(task, tok)
    w.handle(Start(specs))
    for _ in range(3):
        w.step()
    running = {int(r) for r in w.engine.seqs if w.engine.seqs[r].num_generated > 0}
    assert running
    preempted = w.engine.stats().num_preemptions
    w.relay.fill(published(w.engine, 1.3), 1)
    w.handle(LoadWeights(0, 1, keep_kv=True))
    assert w.engine.version == 1 and w.engine.stats().num_preemptions == preempted
    run_to_end(w)
    assert w.engine.stats().num_preemptions == preempted
    scored = {e.req_id: e for e in events_of(ch, "reward_scored")}
    model = w.engine.runner.model
    prompt_of = {s.req_id: s.prompt_ids for s in specs}
    stale = []
    for rid in running:
        t = scored[rid].payload
        k = t.versions.count(0)
        assert 0 < k < len(t.versions) and t.versions == [0] * k + [1] * (len(t.versions) - k)
        ref = training_logprobs(model, prompt_of[rid], t.response_ids)
        stale.append((torch.tensor(t.logprobs[k:]) - ref[k:]).abs().max() > 1e-3)
    assert any(stale)


class LoopbackChannel(FakeChannel):
    """Records what the backend sends; hands it the events queued in `inbox`."""
    def __init__(self):
        super().__init__()
        self.inbox = []

    def get(self, port=0, *, waiting_for="", on=(), timeout=None):
        return self.inbox.pop(0)


def test_backend_sends_typed_messages_and_partial_trajectories_and_refuses_migrate():
    topo = Topology(rank=0, world=3, train_ranks=[0], rollout_ranks=[1, 2], colocate=False,
                    device=torch.device("cpu"))
    ch = LoopbackChannel()
    work = []
    be = RuntimeBackend(topo, ch, t0=0.0, to_trainer=work.append)
    be.command(Interrupt(1, [4, 7]))
    be.command(LoadWeights(0, 3))
    be.notify_publication(2)
    assert ch.sent == [(2, Interrupt(1, [4, 7])), (1, LoadWeights(0, 3)), (1, ReceiveWeights(2)),
                       (2, ReceiveWeights(2))]
    with pytest.raises(TypeError, match="Migrate"):
        be.command(Migrate(0, 1, [4]))
    part = Trajectory(5, 1, [3, 4], [7, 8, 9], [-0.1, -0.2, -0.3], [0, 0, 1], finish_reason="interrupted")
    fresh = SchedRequest(req_id=50, group_id=5, sample_index=0, prompt_index=9, round=0, prompt_len=2)
    resumed = SchedRequest(req_id=51, group_id=5, sample_index=1, prompt_index=9, round=0, prompt_len=2,
                           partial=part)
    be.submit(0, [fresh, resumed], {5: PromptItem(9, [3, 4], "x")})
    dst, msg = ch.sent[-1]
    assert dst == 1 and isinstance(msg, Start) and msg.requests[0].partial is None
    assert msg.requests[1] == StartRequest(51, 5, 1, 9, [3, 4], "x", None, part)
    assert be.sent == [2, 0]
    ch.inbox.append((1, [Event("trajectory_interrupted", 1.0, rank=1, engine=0, req_id=51, group_id=5,
                                version=1, data={"tokens": 3}, payload=part)]))
    ev = be.next_event()
    assert ev.kind == "trajectory_interrupted" and ev.payload is part
    assert be.sent == [1, 0]  # the request left its engine: the deadline message no longer waits on it


# ---- asynchronous reward scoring (RollPacker §4.3, reward.async_workers > 0) ---------------------------------------
class QueueChannel(FakeChannel):
    """What RolloutWorker.run needs of a Channel: poll / get on the worker's port, fed from `inbox`."""
    def __init__(self):
        super().__init__()
        self.inbox = queue.Queue()

    def poll(self, port=0):
        out = []
        while not self.inbox.empty():
            out.append((0, self.inbox.get_nowait()))
        return out

    def get(self, port=0, *, waiting_for="", on=(), timeout=None):
        try:
            return 0, self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise ChannelTimeout(f"waited {timeout}s for {waiting_for}") from None


def gated_reward(task, gate, hold=lambda text, answer: True, calls=None):
    """task.score, but a call `hold` picks waits for `gate` (at most 10 s) first."""
    def fn(text, answer):
        if calls is not None:
            calls.append(text)
        if hold(text, answer):
            gate.wait(10)
        return task.score(text, answer)
    return fn


def async_worker(fn, workers=2, timeout=None, **kw):
    from runtime.reward_scorer import AsyncRewardScorer
    w, ch, task, tok = loaded_worker(**kw)
    w.scorer = AsyncRewardScorer(fn, workers=workers, timeout=timeout)
    return w, ch, task, tok


def wait_for(pred, what, limit_s=10.0):
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < limit_s, f"timed out waiting for {what}"
        time.sleep(0.005)


def all_events(ch):
    return [e for _, batch in list(ch.sent) for e in batch]


def test_async_scoring_decodes_on_while_a_score_is_pending_and_reports_each_sample_once():
    gate = threading.Event()
    try:
        w, ch, task, tok = async_worker(None, workers=4, max_new_tokens=6)
        slow_answer = task.prompts()[0][1]
        w.scorer.fn = gated_reward(task, gate, hold=lambda text, answer: answer == slow_answer)
        specs = group_specs(task, tok, n_groups=2, group_size=2)
        first = [dataclasses.replace(sp, max_new_tokens=1) for sp in specs if sp.group_id == 0]
        w.handle(Start(first))
        run_to_end(w)                                  # group 0 finished; its scores wait on the gate
        assert len(events_of(ch, "trajectory_finished")) == 2 and not events_of(ch, "reward_scored")
        assert len(w.scorer) == 2 and events_of(ch, "engine_idle")   # nothing decoding: idle, scores pending
        # an abort or interrupt of a finished request being scored: nothing to stop here, nothing reported
        w.handle(Abort(0, [sp.req_id for sp in first]))
        w.handle(Interrupt(0, [sp.req_id for sp in first]))
        w.flush()
        assert not events_of(ch, "trajectory_aborted") and not events_of(ch, "trajectory_interrupted")
        steps = w.steps
        w.handle(Start([sp for sp in specs if sp.group_id == 1]))
        run_to_end(w)                                  # decoding went on while group 0's scores were pending
        assert len(events_of(ch, "trajectory_finished")) == 4 and w.steps > steps
        wait_for(lambda: (w.collect_scores(), w.flush(), len(w.scorer) == 2)[-1], "group 1's scores")
        assert {e.group_id for e in events_of(ch, "reward_scored")} == {1}    # group 0's still pending
        gate.set()
        wait_for(lambda: (w.collect_scores(), w.flush(), not len(w.scorer))[-1], "the gated scores")
        events = all_events(ch)
        kinds = [(e.kind, e.group_id) for e in events]
        assert kinds.index(("trajectory_finished", 1)) < kinds.index(("reward_scored", 0))
        scored = [e for e in events if e.kind == "reward_scored"]
        assert sorted(e.req_id for e in scored) == sorted(sp.req_id for sp in specs)   # each exactly once
        answer = {sp.req_id: sp.answer for sp in specs}
        eos = tok.eos_token_id
        for e in scored:
            t = e.payload
            assert (t.group_id, t.sample_index) == (e.group_id, e.req_id % 10) and e.version == 0
            assert t.versions == [0] * len(t.response_ids) and len(t.logprobs) == len(t.response_ids)
            ids = t.response_ids[:-1] if t.response_ids and t.response_ids[-1] == eos else t.response_ids
            want = task.score(tok.decode(ids, skip_special_tokens=False), answer[e.req_id])
            assert (t.reward, t.correct, t.meta["reward_failed"]) == (want.reward, want.correct, False)
            assert e.data == {"reward": want.reward, "correct": want.correct, "failed": False}
        assert w.engine.block_manager.num_free == w.engine.block_manager.num_blocks
    finally:
        gate.set()
        w.scorer.close()


def test_async_scoring_a_raising_verifier_fails_one_score_and_the_run_goes_on():
    calls = []

    def flaky(text, answer):
        calls.append(text)
        if len(calls) == 2:
            raise ZeroDivisionError("verifier bug")
        return RewardResult(1.0, True)
    w, ch, task, tok = async_worker(flaky, workers=1)
    specs = group_specs(task, tok)
    w.handle(Start(specs))
    run_to_end(w)
    wait_for(lambda: (w.collect_scores(), w.flush(), not len(w.scorer))[-1], "the scores")
    scored = events_of(ch, "reward_scored")
    assert sorted(e.req_id for e in scored) == sorted(sp.req_id for sp in specs)
    failed = [e for e in scored if e.data["failed"]]
    assert len(failed) == 1 and failed[0].data == {"reward": 0.0, "correct": False, "failed": True}
    assert failed[0].payload.reward == 0.0 and failed[0].payload.meta["reward_failed"]
    assert all(e.data == {"reward": 1.0, "correct": True, "failed": False} for e in scored if e not in failed)
    w.scorer.close()


def test_async_scoring_a_call_past_its_timeout_scores_zero_failed_and_stop_cancels_the_rest():
    """Through RolloutWorker.run: the loop polls (never blocks on the channel) while scores are pending, a call
    past its adaptive timeout scores 0 and failed, and "stop" returns at once with a verifier still hung."""
    from runtime.build import reward_scorer
    from config import load_config
    gate = threading.Event()
    calls = []
    w, ch, task, tok = loaded_worker()
    w.channel = ch = QueueChannel()   # a loop blocked on it while scores are pending would never see them
    cfg = load_config("configs/tiny.toml", ["--reward.async_workers=2", "--reward.timeout_s=0.2",
                                            "--reward.timeout_min_s=0.1"])
    w.scorer = reward_scorer(cfg, gated_reward(task, gate, hold=lambda text, answer: len(calls) == 1,
                                               calls=calls))
    specs = group_specs(task, tok)
    th = threading.Thread(target=w.run, daemon=True)
    try:
        ch.inbox.put(Start(specs))
        th.start()
        wait_for(lambda: len(events_of(ch, "reward_scored")) == len(specs), "every score (one timed out)", 5.0)
        scored = events_of(ch, "reward_scored")
        killed = [e for e in scored if e.data["failed"]]
        assert len(killed) == 1 and killed[0].data == {"reward": 0.0, "correct": False, "failed": True}
        assert killed[0].payload.reward == 0.0 and w.scorer.timed_out == 1
        kinds = [e.kind for e in all_events(ch)]
        assert kinds.index("engine_idle") < max(i for i, k in enumerate(kinds) if k == "reward_scored")
        assert kinds.count("engine_busy") == kinds.count("engine_idle") == 1   # one busy span: the decoding
        # a new sample whose verifier hangs, then "stop": no waiting for it, nothing reported for it
        gate.clear()
        calls.clear()
        ch.inbox.put(Start([dataclasses.replace(specs[0], req_id=99, group_id=9)]))
        wait_for(lambda: len(calls) == 1, "the hung call")
        ch.inbox.put(Stop())
        th.join(2.0)
        assert not th.is_alive() and not len(w.scorer) and w.scorer.pool._shutdown
        assert [e.req_id for e in events_of(ch, "reward_scored")].count(99) == 0
    finally:
        gate.set()
        w.scorer.close()


class GatedReceiver:
    """A WeightReceiver whose publication arrives only when the test opens the gate."""
    def __init__(self, tensors, version):
        self.gate, self.tensors, self.version, self.hashes = threading.Event(), tensors, version, {}
        self.peers = [0]

    def receive(self, loader):
        assert self.gate.wait(30), "the test never opened the gate"
        loader(iter(self.tensors), self.version)
        return self.version


def test_a_publication_arrives_on_the_relay_thread_while_the_engine_decodes():
    """Laminar §4 (relays off the decode path): a ReceiveWeights returns at once, the engine decodes on while the
    publication arrives, the relay fills whole when it is in, and a LoadWeights waits for it first; the
    `weights_received` event counts the tokens decoded meanwhile."""
    w, ch, task, tok = make_worker(verify=True, max_new_tokens=8)
    rx = GatedReceiver(published(w.engine, 2.0), 5)
    w.relay.receiver = rx
    prompt, answer = task.prompts()[0]
    w.handle(Start([StartRequest(1, 0, 0, 0, tok.encode(prompt, add_special_tokens=False), answer)]))
    w.handle(ReceiveWeights(5))
    for _ in range(3):
        w.step()
        w.relay.take()
    assert w.relay.version == -1 and not w.relay.tensors and w.engine.num_tokens_decoded >= 3
    rx.gate.set()
    w.handle(LoadWeights(0, 5))
    assert w.relay.version == w.engine.version == 5 and w.relay.publications.pending == []
    want = dict(published(w.engine))   # the engine now holds the published (scaled) weights, checked by checksum
    assert all(torch.equal(w.relay.tensors[k], v) for k, v in want.items())
    got = [e for e in w.outbox if e.kind == "weights_received"]
    assert len(got) == 1 and got[0].version == 5 and got[0].data["tokens_decoded"] >= 3
    w.close()
    assert w.relay.publications.thread is None


@pytest.mark.parametrize("report", [True, False])
def test_counters_carry_each_request_s_progress_when_the_preset_reads_it(report):
    """StaleFlow's snapshot (Eq. 1) estimates an engine whose report predates a command from each request's tokens
    so far: with `report_progress` (Preset.reads_progress) every tokens_decoded event carries them."""
    import sched
    sf, sync = sched.load_preset("staleflow"), sched.load_preset("sync")
    assert sf.reads_progress() and not sync.reads_progress()
    assert sf.counters_period_s() == sf.dispatch.p.period_s and sync.counters_period_s() is None
    w, ch, task, tok = make_worker(verify=False, max_new_tokens=8)
    # every engine step by the clock (StaleFlow's period, 0 here), none by the step count
    w.sampling = dataclasses.replace(w.sampling, report_progress=report, counters_every=1000, counters_every_s=0.0)
    prompts = task.prompts()
    w.handle(Start([StartRequest(i, i, 0, i, tok.encode(p, add_special_tokens=False), a)
                    for i, (p, a) in enumerate(prompts[:3])]))
    for _ in range(3):
        w.step()
    sent = [e for _, evs in ch.sent for e in evs] + w.outbox
    counters = [e for e in sent if e.kind == "tokens_decoded"]
    assert len(counters) == 3
    last = counters[-1].data
    if report:
        assert last["progress"] == {rid: s.num_generated for rid, s in w.engine.seqs.items()} and last["progress"]
        assert all(0 < n <= 3 for n in last["progress"].values())
    else:
        assert "progress" not in last


def test_the_step_that_empties_the_engine_reports_its_final_counters():
    """An engine reports its counters every `counters_every` steps and at the step that empties it, so the last
    report of a busy span is its final state (kv_adopted included), as a simulated engine's is."""
    w, ch, task, tok = make_worker(verify=False, max_new_tokens=5)
    w.sampling = dataclasses.replace(w.sampling, counters_every=1000, counters_every_s=None, ignore_eos=True)
    prompts = task.prompts()
    w.handle(Start([StartRequest(i, i, 0, i, tok.encode(p, add_special_tokens=False), a)
                    for i, (p, a) in enumerate(prompts[:3])]))
    for _ in range(20):
        if not w.engine.has_unfinished():
            break
        w.step()
    sent = [e for _, evs in ch.sent for e in evs] + w.outbox
    kinds = [e.kind for e in sent]
    counters = [e for e in sent if e.kind == "tokens_decoded"]
    assert len(counters) == 1 and kinds.index("tokens_decoded") < kinds.index("engine_idle")
    last = counters[-1].data
    assert last["running"] == last["waiting"] == 0 and last["total"] == w.engine.num_tokens_decoded == 3 * 5
    # the KV pool and the preemptions, as a simulated engine's (adaptive_concurrency's overload signal reads them)
    assert last["kv_used"] + last["kv_free"] == w.engine.block_manager.num_blocks
    assert last["preemptions"] == w.engine.scheduler.num_preemptions

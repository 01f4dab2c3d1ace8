"""A request moved between engines with its KV (Laminar's repack and StaleFlow's migration): the
destination adopts the K/V instead of re-prefilling, and decoding continues exactly as it would have on the source.
Engine level here (prefix-shared and partly filled blocks, mid-prefill, the version and room fallbacks); between two
gloo ranks, and a sender that never sends, in tests/runtime/test_kv_transfer_dist.py."""
import pytest
import torch

from engine import GenRequest, KVState, LLMEngine, SamplingParams
from model import Transformer
from model.presets import preset_config
from tests.support.engine import assert_pool_whole, drain, engine, prompts

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed: int = 0) -> Transformer:
    """The `tiny` preset (2 layers, 2 KV heads; no EOS: requests run to their length), weights scaled up so that
    greedy outputs vary."""
    model = Transformer(preset_config("tiny", vocab_size=128)).init_weights(seed=seed).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def qwen3():
    return None, tiny_model(), None


def run_and_move(ours, reqs: list[GenRequest], steps: int, move: int, dst: LLMEngine, **src_kw):
    """Run `reqs` on a source engine for `steps` steps, export request `move` with its KV into `dst`, drain both;
    (source outputs, destination outputs, the exported request, dst's prefill tokens for it, the dst step after)."""
    src = engine(ours, **src_kw)
    ids = [src.add_request(r) for r in reqs]
    for _ in range(steps):
        src.step()
    moved = src.export(ids[move], with_kv=True)
    prefill0 = dst.num_prefill_tokens
    dst.import_request(moved)
    dst.step()
    first = dst.last_step
    outs_dst = drain(dst)
    outs_src = drain(src)
    assert len(src.kept) == (moved.kv is not None)   # the copy's blocks stay held until it is let go
    src.release_kv(ids[move])
    assert_pool_whole(src)
    assert_pool_whole(dst)
    return outs_src, outs_dst, moved, dst.num_prefill_tokens - prefill0, first


def assert_same(got, want):
    assert got.token_ids == want.token_ids and got.request_id == want.request_id
    assert got.logprobs == want.logprobs and got.sampling_logprobs == want.sampling_logprobs  # exactly


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kv_moves_and_decoding_continues_identically_without_prefill(qwen3, temperature):
    _, ours, _ = qwen3
    ps = prompts((7, 13))   # 7 and 13 tokens in blocks of 4: both end in a partly filled block
    sp = SamplingParams(temperature=temperature, max_new_tokens=12, seed=5)

    def reqs():
        return [GenRequest(p, sp, request_id=f"r{i}") for i, p in enumerate(ps)]
    want = engine(ours).generate(reqs())
    dst = engine(ours, block_size=8)   # another block size: the KV lands in other slots of other blocks
    outs_src, outs_dst, moved, prefill, first = run_and_move(ours, reqs(), 6, 1, dst)
    assert 0 < len(moved.token_ids) < 12 and moved.kv.num_tokens == len(ps[1]) + len(moved.token_ids) - 1
    assert prefill == 0 and first.num_tokens == first.num_decode == 1   # the next step was a decode
    assert_same(outs_dst[0], want[1])
    assert_same(outs_src[0], want[0])
    assert len(set(want[1].token_ids)) > 2   # not one token repeated


def test_a_sibling_leaves_its_group_with_the_shared_prompt_blocks(qwen3):
    """GRPO siblings share the prompt's blocks (refcounts > 1, the last one partly filled): the moved one carries a
    copy of its own tokens, the ones left behind keep theirs, both pools end whole."""
    _, ours, _ = qwen3
    (p,) = prompts((10,))

    def reqs():
        return [GenRequest(p, SamplingParams(temperature=1.0, max_new_tokens=12, seed=i), request_id=f"g{i}",
                           group_id=3, sample_index=i) for i in range(3)]
    want = engine(ours).generate(reqs())
    src = engine(ours)
    for r in reqs():
        src.add_request(r)
    src.step()   # the leader's prompt prefilled once, the siblings forked from it
    assert src.block_manager.ref_counts[src.seqs["g1"].block_table[0]] == 3
    moved = src.export("g1", with_kv=True)
    assert moved.kv.num_tokens == 10 and src.block_manager.ref_counts[src.seqs["g0"].block_table[0]] == 2
    dst = engine(ours)
    dst.import_request(moved)
    got, rest = drain(dst), drain(src)
    assert dst.num_prefill_tokens == 0
    assert_same(got[0], want[1])
    for o in rest:
        assert_same(o, want[int(o.request_id[1])])
    assert len(src.kept["g1"]) == 3   # the copy of 10 tokens counts 3 blocks, though the shared ones stayed
    src.release_kv("g1")
    assert_pool_whole(src)
    assert_pool_whole(dst)


def test_a_request_moved_mid_prefill_prefills_only_the_rest(qwen3):
    _, ours, _ = qwen3
    (p,) = prompts((22,))
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=2)
    want = engine(ours, max_batch_tokens=8).generate([GenRequest(p, sp, request_id="x")])
    dst = engine(ours, max_batch_tokens=8)
    _, got, moved, prefill, _ = run_and_move(ours, [GenRequest(p, sp, request_id="x")], 2, 0, dst,
                                             max_batch_tokens=8)
    assert moved.token_ids == [] and moved.kv.num_tokens == 16
    assert prefill == 22 - 16   # what was left of the prompt
    assert_same(got[0], want[0])


def test_kv_of_other_weights_or_without_room_is_not_adopted_the_request_is_re_prefilled(qwen3):
    _, ours, _ = qwen3
    ps = prompts((9, 5))
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, seed=1)
    want = engine(ours).generate([GenRequest(ps[0], sp, request_id="m")])
    newer = LLMEngine(ours, engine(ours).config, version=1)     # same tensors, another version: never read as cached
    _, got, moved, prefill, _ = run_and_move(ours, [GenRequest(ps[0], sp, request_id="m")], 4, 0, newer)
    assert moved.kv.version == 0 and prefill == 9 + len(moved.token_ids)
    assert got[0].token_ids == want[0].token_ids and got[0].versions == [0] * len(moved.token_ids) + \
        [1] * (10 - len(moved.token_ids))
    full = engine(ours, max_num_seqs=1)   # no seat free: waits, then re-prefills
    full.add_request(GenRequest(ps[1], sp, request_id="other"))
    full.step()
    _, got, moved, prefill, _ = run_and_move(ours, [GenRequest(ps[0], sp, request_id="m")], 4, 0, full)
    assert prefill == 9 + len(moved.token_ids)
    assert {o.request_id for o in got} == {"m", "other"}


def test_kv_of_another_model_shape_is_refused_by_name(qwen3):
    _, ours, _ = qwen3
    src, dst = engine(ours), engine(ours)
    src.add_request(GenRequest(prompts((6,))[0], SamplingParams(max_new_tokens=4), request_id="z"))
    src.step()
    u = src.export("z", with_kv=True)
    u.kv = KVState(u.kv.data[:, :1], u.kv.version)   # one layer instead of the model's
    with pytest.raises(ValueError, match="does not fit"):
        dst.import_request(u)
    assert_pool_whole(dst)


# ---- the runtime's side without a cluster: the backend's SendKV, a worker's kept KV ------------------------------
def test_the_backend_sends_the_kv_s_keeper_a_sendkv_right_before_the_destination_s_start():
    from rl.types import Trajectory
    from runtime.backend import RuntimeBackend
    from runtime.messages import SendKV, Start
    from runtime.topology import Topology
    from sched.controller import PromptItem
    from sched.views import Request
    from tests.support.worker import FakeChannel
    topo = Topology(rank=0, world=4, train_ranks=[0], rollout_ranks=[1, 2, 3], colocate=False,
                    device=torch.device("cpu"))
    ch = FakeChannel()
    be = RuntimeBackend(topo, ch, t0=0.0, to_trainer=lambda item: None)

    def part(rank):
        return Trajectory(5, 1, [3, 4], [7, 8], [-0.1, -0.2], [0, 0], finish_reason="interrupted",
                          meta={"kv_rank": rank})
    reqs = [Request(req_id=51, group_id=5, sample_index=1, prompt_index=9, round=0, prompt_len=2, partial=part(3)),
            Request(req_id=52, group_id=5, sample_index=2, prompt_index=9, round=0, prompt_len=2, partial=part(1))]
    be.submit(0, reqs, {5: PromptItem(9, [3, 4], "x")})
    assert [(dst, type(m).__name__) for dst, m in ch.sent] == [(3, "SendKV"), (1, "Start")]
    assert ch.sent[0][1] == SendKV(51, 1) and isinstance(ch.sent[1][1], Start)   # 52's KV is on rank 1 already


def test_a_migrated_request_aborted_while_pending_has_its_kept_kv_dropped_at_its_keeper():
    """The KV a migrating Interrupt kept on the source engine is let go when the request is aborted before its
    resubmission: the lifecycle sends the keeper an Abort, whose worker drops the KV without an event."""
    import sched
    from rl.types import Trajectory
    from sched.controller import Controller, PromptItem
    from sched.decisions import Abort, Interrupt, Submit
    from sched.events import Event
    from sched.resources import EngineView
    ctl = Controller(sched.load_preset("sync"), lambda n: [PromptItem(i, [1, 2], "a") for i in range(n)],
                     group_size=2, prompts_per_step=1, total_steps=1)
    ctl.v.engines = [EngineView(engine=i, version=0) for i in range(2)]
    ctl.v.trainer.published = 0
    ctl.start_round(1)
    ctl.life.admit(Submit(1, [0, 1]))
    ctl.life.interrupt([0, 1], migrate_to=0)
    for rid, meta in ((0, {"kv_rank": 2}), (1, {})):
        ctl.apply(Event("trajectory_interrupted", 0.1, engine=1, req_id=rid, group_id=0, version=0,
                        payload=Trajectory(0, rid, [1, 2], [5], [-0.1], [0], finish_reason="interrupted",
                                           meta=meta)))
    ctl.life.due_migrations()   # (the test does not resubmit them: both stay pending)
    assert ctl.v.requests[0].partial.meta == {"kv_rank": 2, "kv_engine": 1}
    sends = ctl.life.abort(Abort(1, [0, 1]))
    assert sends == [Abort(1, [0], False)], "only the request whose KV is kept is sent, to its keeper"
    assert [r.state for r in ctl.v.requests.values()] == ["aborted", "aborted"]

    from runtime.messages import Start, StartRequest
    from tests.support.worker import events_of, loaded_worker
    w, ch, task, tok = loaded_worker(verify=False)
    w.handle(Start([StartRequest(REQ, 0, 0, 0, tok.encode(task.prompts()[0][0], add_special_tokens=False), "a")]))
    w.step()
    w.kv.sender = object()   # as on a rank with a KV group: the Interrupt keeps the KV
    free = w.engine.block_manager.num_free
    w.handle(Interrupt(0, [REQ], dst=0))
    assert REQ in w.kv.out and w.engine.kept[REQ]
    w.handle(Abort(0, [REQ]))
    w.flush()
    assert not w.kv.out and not events_of(ch, "trajectory_aborted")
    assert not w.engine.kept and w.engine.block_manager.num_free == w.engine.block_manager.num_blocks > free


REQ = 7


def test_kept_kv_counts_against_the_engines_pool_until_released(qwen3):
    """The copy of an exported request's KV (a migration's, kept until the keeper sends it) holds as many of the
    source pool's blocks as it fills: the engine cannot admit past its budget while it keeps KV for others."""
    _, ours, _ = qwen3
    src = engine(ours, num_kv_tokens=48, block_size=4)   # 12 blocks
    src.add_request(GenRequest([1, 2, 3, 4, 5, 6, 7], SamplingParams(max_new_tokens=20), request_id="a"))
    for _ in range(6):
        src.step()
    free0 = src.block_manager.num_free
    u = src.export("a", with_kv=True)
    assert u.kv.num_tokens == 12 and src.block_manager.num_free == free0 == 9   # its 3 blocks freed, 3 held
    src.add_request(GenRequest(list(range(1, 38)), SamplingParams(max_new_tokens=2), request_id="b"))
    src.step()
    assert not src.scheduler.running            # 37 tokens need 10 blocks: the 12-block pool minus 3 held is 9
    src.release_kv("a")
    src.release_kv("a")                         # twice is harmless
    assert src.block_manager.num_free == 12
    src.step()
    assert [q.request_id for q in src.scheduler.running] == ["b"]
    drain(src)
    assert_pool_whole(src)


def _finished(ch):
    """The scored trajectory of request REQ among the events a worker sent."""
    return next(e.payload for _, evs in ch.sent for e in evs if e.kind == "reward_scored" and e.req_id == REQ)


class Wire:
    """KVSender and recv_kv without a process group: what a rank sends, the named rank receives."""
    def __init__(self):
        self.sent = {}

    def send(self, kv, req_id, dst):
        self.sent[req_id, dst] = kv

    def close(self):
        pass


class WireReceiver:
    """KVReceiver without a process group or thread: what was sent to `rank` is in at the next look."""
    def __init__(self, wire: Wire, rank: int):
        self.wire, self.rank, self.queued = wire, rank, []

    def receive(self, req_id, src):
        self.queued.append(req_id)

    def take(self):
        out = [(r, self.wire.sent.pop((r, self.rank))) for r in self.queued if (r, self.rank) in self.wire.sent]
        self.queued = [r for r in self.queued if all(r != got for got, _ in out)]
        return out

    def wait_all(self):
        out = self.take()
        assert not self.queued, "waited for a KV that was never sent"
        return out

    def close(self):
        pass


@pytest.mark.parametrize("case", ["kept", "sent", "reloaded"])
def test_a_worker_resumes_a_migrated_request_from_its_kv_kept_here_or_received(case):
    """kept: resumed on the rank that kept the KV; sent: SendKV from that rank, received by another worker, which
    took the Start before the KV was in without waiting for it (the request joins its engine once the KV is in, or
    when another message makes the worker wait for it); reloaded: the keeper loaded new weights (the same tensors
    as a new version) before the resume, so the KV was dropped and the request is re-prefilled."""
    import dataclasses
    from runtime.messages import SendKV, Start, StartRequest
    from sched.decisions import Interrupt, LoadWeights
    from tests.support.worker import make_worker, published
    wire = Wire()

    def worker(rank):
        w, ch, task, tok = make_worker(verify=False, max_new_tokens=10, rank=rank)
        w.kv.sender, w.kv.receiver = wire, WireReceiver(wire, rank)
        prompt, answer = task.prompts()[0]
        return w, ch, StartRequest(REQ, 0, 0, 0, tok.encode(prompt, add_special_tokens=False), answer)

    ref, ref_ch, spec = worker(1)
    ref.handle(Start([spec]))
    while ref.engine.has_unfinished():
        ref.step()
    want = _finished(ref_ch)
    w, ch, spec = worker(1)
    w.handle(Start([spec]))
    for _ in range(3):
        w.step()
    w.handle(Interrupt(0, [REQ], dst=1))
    part = next(e.payload for e in w.outbox if e.kind == "trajectory_interrupted")
    assert part.meta["kv_rank"] == 1 and REQ in w.kv.out
    if case == "reloaded":
        w.relay.fill(published(w.engine), 0)
        w.handle(LoadWeights(0, 0))
        assert not w.kv.out
    dst, dst_ch = w, ch
    if case == "sent":   # the destination takes the Start before the KV is in and does not wait for it
        dst, dst_ch, _ = worker(2)
        prefill0 = dst.engine.num_prefill_tokens
        dst.handle(Start([dataclasses.replace(spec, partial=part)]))
        assert REQ in dst.kv.incoming and not dst.engine.has_unfinished()
        dst._take_kv()
        assert REQ in dst.kv.incoming   # nothing sent yet: still coming
        w.handle(SendKV(REQ, 2))
        assert not w.kv.out and wire.sent[REQ, 2] is not None
        dst.handle(Interrupt(0, [REQ + 1]))   # any message but a Start / SendKV first takes in the KV coming
        assert not dst.kv.incoming and REQ in dst.engine.seqs
    else:
        prefill0 = dst.engine.num_prefill_tokens
        dst.handle(Start([dataclasses.replace(spec, partial=part)]))
    while dst.engine.has_unfinished():
        dst.step()
    got = _finished(dst_ch)
    assert got.response_ids == want.response_ids and not wire.sent and not dst.kv.out
    if case == "reloaded":
        assert dst.engine.num_prefill_tokens - prefill0 == len(spec.prompt_ids) + len(part.response_ids)
    else:
        assert dst.engine.num_prefill_tokens == prefill0 and got.logprobs == want.logprobs
        assert dst.kv.adopted == len(spec.prompt_ids) + len(part.response_ids) - 1 and dst.kv.refused == 0

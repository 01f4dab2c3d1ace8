"""Multi-turn requests (engine/turns.py): held between turns with their KV, extended with an observation whose tokens
alone are prefilled, never the history; the KV reuse changes nothing but the cost (the turns equal those of a
request recomputing the whole history), on the base path and the CPU engine's multi-step decode; eviction under
memory pressure, abort, export / import, weight loads and reset with held requests."""
import pytest
import torch

from engine import GenRequest, SamplingParams, UnfinishedRequest
from model import load_model
from tests.support.engine import assert_pool_whole, engine, prompts, sharp_model

pytestmark = pytest.mark.usefixtures("one_thread")

STOP = tuple(range(20, 36))          # 16 of the 128 tokens end a turn: turns of a few tokens
OBS = ([5, 6, 7], [8, 9, 11, 12, 13])  # the observations of a 3-turn episode
SEEDED = SamplingParams(temperature=1.0, seed=11, max_new_tokens=120, stop_token_ids=STOP)
GREEDY = SamplingParams(temperature=0, max_new_tokens=120, stop_token_ids=STOP)
PATHS = {"base": dict(), "multi-step": dict(cpu_decode_steps=4)}   # the CPU engine's C loop of several decode steps


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("q3")
    sharp_model("qwen3", path)
    return load_model(path).eval()


def next_output(eng, rid, max_steps=500):
    """Step until request `rid` finishes a turn (or the request)."""
    for _ in range(max_steps):
        eng.calls = getattr(eng, "calls", 0) + 1
        for out in eng.step():
            if out.request_id == rid:
                return out
    raise AssertionError(f"request {rid} did not finish a turn in {max_steps} steps")


def episode(eng, prompt, params, rid="ep", observations=OBS, between=None):
    """Run a multi-turn request: each held turn extended with the next observation (after `between(eng)`), the
    last one ended. Returns (final output, per turn the response length when it ended)."""
    eng.add_request(GenRequest(prompt, params, request_id=rid, multi_turn=True))
    obs, ends = list(observations), []
    while True:
        out = next_output(eng, rid)
        ends.append(len(out.token_ids))
        if not out.held:
            return out, ends
        assert out.finish_reason == "stop" and out.token_ids[-1] in STOP
        if not obs:
            return eng.end(rid), ends
        if between is not None:
            between(eng)
        eng.extend(rid, obs.pop(0))


def model_spans(mask):
    """The runs of sampled tokens (turns) in a mask, as (start, end)."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def check_transcript(out, prompt_len):
    """Mask, logprobs and versions of a 3-turn episode's output: observation tokens masked 0 with logprob 0.0."""
    assert out.mask is not None and len(out.mask) == len(out.token_ids) == len(out.logprobs) == len(out.versions)
    turns = model_spans(out.mask)
    assert len(turns) == 3
    for (_, end), obs in zip(turns, OBS):
        assert out.token_ids[end:end + len(obs)] == obs and out.mask[end:end + len(obs)] == [0] * len(obs)
        assert out.logprobs[end:end + len(obs)] == [0.0] * len(obs)
    assert all(lp < 0 for lp, m in zip(out.logprobs, out.mask) if m)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_kv_reused_across_turns_and_nothing_else_changes(model, path):
    prompt = prompts((9,))[0]
    eng = engine(model, **PATHS[path])
    out, ends = episode(eng, prompt, SEEDED)
    check_transcript(out, len(prompt))
    assert out.finish_reason == "stop" and not out.held
    # prefilled: the prompt, then per extension its observation and the last sampled token; never the history
    assert eng.num_prefill_tokens == len(prompt) + sum(len(o) + 1 for o in OBS)
    assert eng.num_tokens_decoded == sum(out.mask)
    assert_pool_whole(eng)
    if path == "multi-step":
        assert eng.num_steps > eng.calls   # some calls ran several decode steps in the C loop
    # each later turn equals the one a request recomputing the whole history samples (same seed, same counters)
    for k, (_, end) in enumerate(model_spans(out.mask)[1:]):
        start = ends[k] + len(OBS[k])
        fresh = engine(model, **PATHS[path])
        fresh.import_request(UnfinishedRequest(
            GenRequest(prompt, SEEDED, request_id="ref"), token_ids=out.token_ids[:start],
            logprobs=out.logprobs[:start], sampling_logprobs=out.logprobs[:start], versions=out.versions[:start],
            arrival_time=0.0))
        ref = next_output(fresh, "ref")
        assert ref.token_ids[start:] == out.token_ids[start:end]
        torch.testing.assert_close(ref.logprobs[start:], out.logprobs[start:end], atol=2e-5, rtol=0)
        assert fresh.num_prefill_tokens == len(prompt) + start   # the reference did recompute the history


def test_greedy_turns_equal_a_fresh_request_on_the_whole_history(model):
    prompt = prompts((6,), seed=1)[0]
    out, ends = episode(engine(model), prompt, GREEDY)
    check_transcript(out, len(prompt))
    for k, (_, end) in enumerate(model_spans(out.mask)[1:]):
        start = ends[k] + len(OBS[k])
        history = prompt + out.token_ids[:start]
        ref = engine(model).generate([GenRequest(history, GREEDY)])[0]
        assert ref.token_ids == out.token_ids[start:end]
        torch.testing.assert_close(ref.logprobs, out.logprobs[start:end], atol=2e-5, rtol=0)


def test_a_held_request_frees_its_decode_slot_and_keeps_its_blocks(model):
    eng = engine(model, max_num_seqs=1)
    prompt = prompts((9,))[0]
    eng.add_request(GenRequest(prompt, SEEDED, request_id="ep", multi_turn=True))
    held = next_output(eng, "ep")
    assert held.held and held.mask == [1] * len(held.token_ids)
    st = eng.stats()
    assert st.running == [] and st.held == ["ep"] and st.kv_blocks_used > 0
    assert not eng.has_unfinished()        # nothing to step while it waits
    # the one seat is free: another request runs to the end while "ep" is held, its blocks untouched
    used = st.kv_blocks_used
    plain = SamplingParams(max_new_tokens=6, seed=1, ignore_eos=True)
    other = eng.generate([GenRequest(prompts((5,), seed=2)[0], plain)])[0]
    assert len(other.token_ids) == 6 and eng.stats().kv_blocks_used == used and eng.stats().held == ["ep"]
    eng.extend("ep", OBS[0])
    assert eng.stats().waiting == ["ep"] and eng.stats().held == []
    while eng.has_unfinished():
        eng.step()
    eng.end("ep")
    assert_pool_whole(eng)


def test_evicted_kv_is_recomputed_with_the_same_tokens(model):
    prompt = prompts((9,))[0]
    want, _ = episode(engine(model), prompt, SEEDED)
    eng = engine(model)
    got, _ = episode(eng, prompt, SEEDED, between=lambda e: e.scheduler.evict())
    assert got.token_ids == want.token_ids and got.mask == want.mask
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=2e-5, rtol=0)
    assert eng.stats().num_evictions == 2
    assert eng.num_prefill_tokens == len(prompt) + sum(  # the whole history recomputed at each extension
        e + len(o) + len(prompt) for e, o in zip(_turn_ends(want), OBS))
    assert_pool_whole(eng)


def _turn_ends(out):
    return [end for _, end in model_spans(out.mask)[:-1]]


@pytest.mark.parametrize("path", sorted(PATHS))
def test_memory_pressure_drops_held_kv_rather_than_failing(model, path):
    ps = prompts((9, 7, 12, 5, 10, 8), seed=3)
    params = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=60, stop_token_ids=STOP) for i in range(6)]

    def run(eng):
        for i, (p, sp) in enumerate(zip(ps, params)):
            eng.add_request(GenRequest(p, sp, request_id=i, multi_turn=True))
        left, outs = {i: list(OBS) for i in range(6)}, {}
        for _ in range(3000):
            for o in eng.step():
                if not o.held:
                    outs[o.request_id] = o
                elif left[o.request_id]:
                    eng.extend(o.request_id, left[o.request_id].pop(0))
                else:
                    outs[o.request_id] = eng.end(o.request_id)
            if len(outs) == 6:
                return [outs[i] for i in range(6)]
        raise AssertionError("episodes did not finish")

    roomy = run(engine(model, **PATHS[path]))
    eng = engine(model, num_kv_tokens=96, max_batch_tokens=16, **PATHS[path])
    tight = run(eng)
    assert eng.stats().num_evictions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert [o.mask for o in tight] == [o.mask for o in roomy]
    assert_pool_whole(eng)


def test_abort_of_a_held_request_frees_its_blocks(model):
    eng = engine(model)
    eng.add_request(GenRequest(prompts((9,))[0], SEEDED, request_id="ep", multi_turn=True))
    held = next_output(eng, "ep")
    eng.extend("ep", OBS[0])
    eng.step()                                    # waiting with its blocks, or running: aborted either way
    assert eng.block_manager.num_used > 0
    out = eng.abort("ep")
    assert out.finish_reason == "abort" and out.token_ids[:len(held.token_ids)] == held.token_ids
    assert out.mask[len(held.token_ids):len(held.token_ids) + 3] == [0, 0, 0]
    assert_pool_whole(eng)
    eng.add_request(GenRequest(prompts((9,))[0], SEEDED, request_id="ep2", multi_turn=True))
    assert next_output(eng, "ep2").held
    assert eng.abort("ep2").finish_reason == "abort"
    assert_pool_whole(eng)


@pytest.mark.parametrize("with_kv", [True, False])
def test_export_of_a_held_request_resumes_held_elsewhere(model, with_kv):
    prompt = prompts((9,))[0]
    want, _ = episode(engine(model), prompt, SEEDED)
    a, b = engine(model), engine(model)
    a.add_request(GenRequest(prompt, SEEDED, request_id="ep", multi_turn=True))
    first = next_output(a, "ep")
    a.extend("ep", OBS[0])
    second = next_output(a, "ep")
    u = a.export("ep", with_kv=with_kv)
    a.release_kv("ep")
    assert u.held and u.mask == second.mask
    assert_pool_whole(a)
    b.import_request(u)
    st = b.stats()
    assert st.held == ["ep"] and (st.kv_blocks_used > 0) == with_kv
    b.extend("ep", OBS[1])
    before = b.num_prefill_tokens
    last = next_output(b, "ep")
    out = b.end("ep")
    assert out.token_ids == want.token_ids and out.mask == want.mask and len(first.token_ids) < len(last.token_ids)
    kept = len(prompt) + len(second.token_ids) - 1
    assert b.num_prefill_tokens - before == len(OBS[1]) + 1 + (0 if with_kv else kept)
    assert_pool_whole(b)


@pytest.mark.parametrize("keep_kv", [False, True])
def test_weight_load_while_held_drops_or_keeps_its_kv(model, keep_kv):
    prompt = prompts((9,))[0]
    want, _ = episode(engine(model), prompt, SEEDED)
    eng = engine(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    got, _ = episode(eng, prompt, SEEDED, between=lambda e: e.load_weights(weights, e.version + 1, keep_kv=keep_kv))
    assert got.token_ids == want.token_ids    # the same weights: recomputed or kept, the same tokens
    obs_versions = [v for v, m in zip(got.versions, got.mask) if not m]
    assert obs_versions == [1] * len(OBS[0]) + [2] * len(OBS[1])   # an appended token: the version it came in at
    reused = len(prompt) + sum(len(o) + 1 for o in OBS)
    assert (eng.num_prefill_tokens == reused) == keep_kv
    assert_pool_whole(eng)


def test_reset_and_bad_extensions(model):
    eng = engine(model)
    eng.add_request(GenRequest(prompts((9,))[0], SEEDED, request_id="ep", multi_turn=True))
    held = next_output(eng, "ep")
    with pytest.raises(ValueError, match="leave none to generate"):
        eng.extend("ep", [5] * (SEEDED.max_new_tokens - len(held.token_ids)))
    assert eng.room("ep") == SEEDED.max_new_tokens - len(held.token_ids) - 1
    eng.extend("ep", [5])
    with pytest.raises(KeyError, match="not held"):
        eng.extend("ep", [5])
    with pytest.raises(KeyError, match="not held"):
        eng.end("nope")
    assert eng.reset() == ["ep"]
    assert_pool_whole(eng)


def test_single_turn_requests_are_unchanged(model):
    out = engine(model).generate([GenRequest(prompts((9,))[0], SEEDED)])[0]
    assert out.mask is None and not out.held and out.finish_reason == "stop" and out.token_ids[-1] in STOP

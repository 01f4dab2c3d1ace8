"""A rollout worker that isolates engine faults (Laminar §3.3; runtime/rollout_worker.py): it streams each request's
tokens to the partial-response pool, survives a failed step (an allocation failure, non-finite state, an injected
fault), voids what the controller sent before it heard, rebuilds and rejoins; the requests resumed from the pool on
another worker end as they would have without the failure."""
import dataclasses

import pytest
import torch

from runtime.faults import EngineFault, Injector, parse
from runtime.messages import Start
from runtime.engine_health import Health
from runtime.watchdog import Phase
from sched.decisions import LoadWeights, ResetEngine
from sched.partials import PartialPool
from tests.support.worker import events_of, group_specs, loaded_worker, published, run_to_end

pytestmark = pytest.mark.usefixtures("one_thread")


def isolating(max_new_tokens=12, failures=3, **kw):
    w, ch, task, tok = loaded_worker(max_new_tokens=max_new_tokens, verify=False, **kw)
    w.health.isolated = failures
    w.sampling = dataclasses.replace(w.sampling, counters_every=2)
    return w, ch, task, tok


def pool_of(w, ch, specs) -> PartialPool:
    """The controller's pool as the worker's streamed chunks build it."""
    pool = PartialPool()
    for s in specs:
        pool.open(s.req_id, s.partial)
    for e in events_of(ch, "tokens_decoded") + [e for e in w.outbox if e.kind == "tokens_decoded"]:
        for rid, chunk in (e.payload or {}).get("partials", {}).items():
            pool.grow(rid, chunk)
    return pool


def fail_next_step(w, exc):
    real = w.engine.step

    def step():
        w.engine.step = real
        raise exc
    w.engine.step = step


def test_an_allocation_failure_is_isolated_and_the_pool_resumes_every_request_as_if_it_never_failed():
    ref, ref_ch, task, tok = loaded_worker(max_new_tokens=12, verify=False)
    specs = group_specs(task, tok)
    ref.handle(Start(specs))
    run_to_end(ref)
    want = {e.req_id: e.payload for e in events_of(ref_ch, "reward_scored")}

    a, a_ch, _, _ = isolating()
    a.handle(Start(specs))
    for _ in range(5):
        a.step()
    held_before = {rid: s.num_generated for rid, s in a.engine.seqs.items()}
    assert len(held_before) >= 4
    fail_next_step(a, torch.OutOfMemoryError("CUDA out of memory (simulated)"))
    a.step()
    failed, = events_of(a_ch, "engine_failed")
    assert failed.data["error"].startswith("OutOfMemoryError") and not failed.data["permanent"]
    assert failed.data["held"] == held_before and a.health.state is Health.FAILED
    assert not a.engine.has_unfinished() and not a.answers and events_of(a_ch, "engine_idle")
    assert a.engine.block_manager.num_free == a.engine.block_manager.num_blocks

    pool = pool_of(a, a_ch, specs)
    kept = {rid: len(pool.entries[rid].ids) for rid in held_before}
    assert all(0 < kept[r] <= held_before[r] and held_before[r] - kept[r] < 2 for r in held_before), (kept, held_before)
    # the controller resumes them on another worker from the pool
    b, b_ch, _, _ = isolating()
    resumed = [dataclasses.replace(s, partial=pool.take(s.req_id, None, s.group_id, s.sample_index, s.prompt_ids,
                                                         s.prompt_index)) for s in specs if s.req_id in held_before]
    b.handle(Start(resumed))
    run_to_end(b)
    for e in events_of(b_ch, "reward_scored"):
        t, w0 = e.payload, want[e.req_id]
        assert t.response_ids == w0.response_ids and t.versions == w0.versions
        assert torch.allclose(torch.tensor(t.logprobs), torch.tensor(w0.logprobs), atol=1e-5)
    assert {e.req_id for e in events_of(b_ch, "reward_scored")} == set(held_before)

    # before the controller heard: a Start and a LoadWeights are void; then ResetEngine, a rebuild, a rejoin
    a.handle(Start(specs[:1]))
    a.handle(LoadWeights(0, 0))
    a.flush()
    assert not a.engine.has_unfinished() and not events_of(a_ch, "weights_loaded")[1:]
    a.handle(ResetEngine(0))
    assert a.health.state is Health.REBUILDING
    a.health.rebuild()
    a.flush()
    back, = events_of(a_ch, "engine_recovered")
    assert back.version == 0 and back.data["reloaded"] is False and a.health.state is Health.OK
    a.handle(Start(specs[:1]))
    run_to_end(a)
    assert events_of(a_ch, "reward_scored")[-1].payload.response_ids == want[specs[0].req_id].response_ids


def test_non_finite_weights_fail_the_engine_and_the_rebuild_reloads_them_from_the_relay():
    w, ch, task, tok = isolating(max_new_tokens=6)
    nan = [(k, torch.full_like(v, float("nan"))) for k, v in published(w.engine)]
    w.engine.load_weights(nan, 0)
    assert not w.engine.weights_finite()
    w.handle(Start(group_specs(task, tok, 1, 2)))
    w.step()
    failed, = events_of(ch, "engine_failed")
    assert failed.data["error"].startswith("FloatingPointError: non-finite logits")
    assert not events_of(ch, "trajectory_aborted"), "an isolating engine dropped a request instead of failing"
    w.handle(ResetEngine(0))
    w.health.rebuild()
    w.flush()
    back, = events_of(ch, "engine_recovered")
    assert back.data["reloaded"] is True and w.engine.weights_finite()
    w.handle(Start(group_specs(task, tok, 1, 2)))
    run_to_end(w)
    assert len(events_of(ch, "reward_scored")) == 2


def test_without_isolation_a_failed_step_ends_the_rank_and_non_finite_logits_drop_the_request():
    w, ch, task, tok = loaded_worker(verify=False)
    assert w.health.isolated == 0
    w.handle(Start(group_specs(task, tok, 1, 1)))
    fail_next_step(w, torch.OutOfMemoryError("simulated"))
    with pytest.raises(torch.OutOfMemoryError):
        w.step()
    w, ch, task, tok = loaded_worker(verify=False)
    w.engine.load_weights([(k, torch.full_like(v, float("nan"))) for k, v in published(w.engine)], 0)
    w.handle(Start(group_specs(task, tok, 1, 1)))
    w.step()
    w.flush()
    assert events_of(ch, "trajectory_aborted")[0].data["error"] == "non-finite logits"
    assert not events_of(ch, "engine_failed")


def test_an_engine_failing_past_its_count_or_failing_to_rebuild_is_retired():
    w, ch, task, tok = isolating(failures=1)
    for i in range(2):
        w.handle(Start(group_specs(task, tok, 1, 1)))
        fail_next_step(w, RuntimeError(f"boom {i}"))
        w.step()
        w.handle(ResetEngine(0))
        if i == 0:
            w.health.rebuild()
    w.flush()
    assert [e.data["permanent"] for e in events_of(ch, "engine_failed")] == [False, True] and w.health.retired
    with pytest.raises(RuntimeError, match="while its engine is failed and the controller knows it"):
        w.handle(Start(group_specs(task, tok, 1, 1)))

    # a rebuild that cannot restore finite weights (the relay holds none) retires the engine
    w, ch, task, tok = isolating()
    w.relay.tensors, w.relay.version = {}, -1
    w.engine.load_weights([(k, torch.full_like(v, float("nan"))) for k, v in published(w.engine)], 0)
    w.handle(Start(group_specs(task, tok, 1, 1)))
    w.step()
    w.handle(ResetEngine(0))
    w.health.rebuild()
    w.flush()
    last = events_of(ch, "engine_failed")[-1]
    assert last.data["permanent"] and "rebuild failed" in last.data["error"] and w.health.retired
    assert not events_of(ch, "engine_recovered")


def test_an_injected_engine_fault_fires_once_on_its_rank_with_its_down_time():
    (f,), = parse("fail 2 decode 1 1.5")
    assert f.seconds == 1.5 and str(f) == "fail rank 2 at decode step 1 (down 1.5s)"
    assert parse("fail 2 decode 1")[0][0].seconds == 0.0
    with pytest.raises(ValueError, match="fail, whose PHASE is decode"):
        parse("fail 2 train 1")
    inj = Injector(parse("fail 2 decode 3 1.5")[0], rank=2, store=None)
    inj.at(Phase.DECODE, 5)   # the STEP-th decode report counts, whatever the version
    inj.at(Phase.PUBLISH, 5)
    inj.at(Phase.DECODE, 0)
    assert inj.take_engine_fault() is None
    inj.at(Phase.DECODE, 0)
    e = inj.take_engine_fault()
    assert isinstance(e, EngineFault) and e.down_s == 1.5 and inj.take_engine_fault() is None
    inj.at(Phase.DECODE, 0)   # once
    assert inj.take_engine_fault() is None
    other = Injector(parse("fail 2 decode 1")[0], rank=3, store=None)
    for _ in range(3):
        other.at(Phase.DECODE, 1)   # another rank's fault: nothing here
    assert other.take_engine_fault() is None

"""The simulator's engine model, cost model and clock (sim/engine.py, sim/cost.py, sim/clock.py)."""
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from sched.decisions import Abort, Interrupt, LoadWeights, Migrate
from sched.views import Request
from sched.controller import PromptItem
from sim.backend import SimBackend, SimStalled
from sim.clock import EventQueue
from sim.cost import CostModel, RewardLatency, RewardTask
from sim.profiles import PROFILES
from sim.tokens import FAKE_LOGPROB, FAKE_TOKEN, RunList, fake_run
from sim.workload import TraceWorkload

NO_REWARD_DELAY = RewardLatency((RewardTask("none", 1.0, 1e-9, 0.0, 1.0),))


def cost(**kw) -> CostModel:
    base = dict(name="test", k1=1e-6, k2=1e-3, k3=1e-4, k4=1e-3, prefill_s_per_token=1e-5, kv_capacity_tokens=16 * 1000,
                train_s_per_token=1e-4, publish_s=0.5, load_s=0.25, reward=NO_REWARD_DELAY, block_size=16,
                max_num_seqs=64)
    base.update(kw)
    return CostModel(**base)


def backend(c: CostModel, lens: list[list[int]], prompt_len: int = 16, engines: int = 1) -> SimBackend:
    w = TraceWorkload("t", tuple((prompt_len, tuple(x)) for x in lens))
    b = SimBackend(c, w, engines, 1, seed=0)
    for e in b.engines:
        e.version = 0
    return b


def submit(b: SimBackend, lens: list[list[int]], prompt_len: int = 16, engine: int = 0, first_req: int = 0) -> None:
    reqs, prompts, rid = [], {}, first_req
    for p, group in enumerate(lens):
        prompts[p] = PromptItem(p, RunList.of(1, prompt_len), None)
        for k in range(len(group)):
            reqs.append(Request(rid, p, k, p, 0, prompt_len))
            rid += 1
    b.submit(engine, reqs, prompts)


def drain(b: SimBackend) -> list:
    out = []
    while True:
        try:
            out.append(b.next_event())
        except SimStalled:
            return out


def finished(events) -> list:
    return [e for e in events if e.kind == "trajectory_finished"]


# ----------------------------------------------------------------------------------------------------- cost model
def test_step_time_grows_with_batch_and_kv():
    c = PROFILES["h800_7b"]
    assert c.step_s(256, 0) > c.step_s(64, 0)           # compute-bound past k2 / k3 sequences
    assert c.step_s(64, 10**6) > c.step_s(64, 10**5)     # KV reads
    assert c.step_s(1, 0) == pytest.approx(c.k2 + c.k4)  # weight-read floor
    assert c.decode_tokens_per_s(128, 10**5) > c.decode_tokens_per_s(8, 10**4)  # batching pays


@given(n=st.integers(1, 512), kv0=st.integers(0, 10**6), m=st.integers(0, 3000))
@settings(max_examples=60, deadline=None)
def test_closed_form_steps_match_a_loop_and_invert(n, kv0, m):
    c = PROFILES["h800_14b"]
    loop = sum(c.step_s(n, kv0 + j * n) for j in range(m))
    assert c.steps_s(n, kv0, m) == pytest.approx(loop, rel=1e-9, abs=1e-12)
    dt = c.steps_s(n, kv0, m)
    j = c.steps_reaching(n, kv0, dt)
    assert c.steps_s(n, kv0, j) >= dt - 1e-9 and (j == 0 or c.steps_s(n, kv0, j - 1) < dt)


def test_every_profile_documents_its_constants():
    for p in PROFILES.values():
        for k in ("k1", "k2", "k3", "k4", "train_s_per_token", "publish_s", "load_s", "kv_capacity_tokens"):
            assert k in p.sources, (p.name, k)
        assert p.kv_capacity_tokens >= 4096 and p.step_s(1, 1000) > 0


def test_bad_profile_is_rejected():
    with pytest.raises(ValueError, match="k1 must be >= 0"):
        cost(k1=-1.0)


def test_event_queue_orders_by_time_then_push_order():
    q = EventQueue()
    for t, x in [(2.0, "c"), (1.0, "a"), (1.0, "b")]:
        q.push(t, x)
    assert [q.pop()[1] for _ in range(3)] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="past"):
        q.push(0.5, "late")


# ---------------------------------------------------------------------------------------------------- the engine
def test_kv_capacity_forces_preemption_and_is_never_exceeded():
    c = cost(kv_capacity_tokens=16 * 64)              # 64 blocks; 8 x (1 prompt + 13 own) blocks at the end
    lens = [[200], [200], [200], [200], [200], [200], [200], [200]]
    b = backend(c, lens, prompt_len=16)
    submit(b, lens)
    ev = drain(b)
    e = b.engines[0]
    assert e.preemptions > 0 and e.peak_blocks <= e.cap
    fin = finished(ev)
    assert len(fin) == 8 and all(x.data["tokens"] == 200 for x in fin)
    trajs = [x.payload for x in ev if x.kind == "reward_scored"]
    assert all(len(t.response_ids) == 200 and t.versions == [0] * 200 for t in trajs)
    assert sum(t.meta["preemptions"] for t in trajs) == e.preemptions
    assert e.reprefill_s == 0 and e.prefill_s_total > 0   # a preemption's recompute is not a weight load's


@given(lens=st.lists(st.lists(st.integers(1, 120), min_size=1, max_size=4), min_size=1, max_size=6),
       prompt_len=st.integers(1, 40), blocks=st.integers(20, 80), seats=st.integers(1, 8))
@settings(max_examples=40, deadline=None)
def test_engine_property_everything_finishes_within_capacity(lens, prompt_len, blocks, seats):
    c = cost(kv_capacity_tokens=16 * blocks, max_num_seqs=seats)
    b = backend(c, lens, prompt_len)
    submit(b, lens, prompt_len)
    ev = drain(b)
    fin = finished(ev)
    want = sorted(x for g in lens for x in g)
    assert sorted(x.data["tokens"] for x in fin) == want
    assert b.engines[0].peak_blocks <= b.engines[0].cap
    assert not b.engines[0].running and not b.engines[0].waiting
    kinds = [x.kind for x in ev if x.kind in ("engine_busy", "engine_idle")]
    assert kinds[0] == "engine_busy" and kinds[-1] == "engine_idle"


def test_continuous_batching_admits_as_seats_free():
    c = cost(max_num_seqs=2)
    lens = [[10], [100], [10], [10]]
    b = backend(c, lens)
    submit(b, lens)
    order = [x.req_id for x in finished(drain(b))]
    assert order == [0, 2, 3, 1]  # 2 and 3 took the seat 0 freed, long before 1 finished


def test_a_bigger_batch_decodes_each_sequence_slower():
    c = cost(k2=1e-4, k3=1e-4, k4=0.0)  # compute-bound almost at once
    alone = backend(c, [[100]])
    submit(alone, [[100]])
    t_alone = finished(drain(alone))[0].t
    crowd = backend(c, [[100]] * 16)
    submit(crowd, [[100]] * 16)
    t_crowd = max(x.t for x in finished(drain(crowd)))
    assert t_crowd > 5 * t_alone
    assert t_alone == pytest.approx(c.prefill_s(16) + c.steps_s(1, 16, 100))


def test_group_siblings_share_prompt_blocks():
    c = cost()
    b = backend(c, [[50] * 8], prompt_len=160)  # 10 full prompt blocks
    submit(b, [[50] * 8], prompt_len=160)
    e = b.engines[0]
    assert e.shared_blocks == 10 and len(e.running) == 8 and e.need(0) == 10
    solo = backend(c, [[50]] * 8, prompt_len=160)
    submit(solo, [[50]] * 8, prompt_len=160)
    assert solo.engines[0].need(0) == 80


def test_abort_reports_tokens_and_requeue():
    c = cost()
    b = backend(c, [[1000, 1000]])
    submit(b, [[1000, 1000]])
    b.run_until(0.05)  # let it decode a while
    b.command(Abort(0, [0], requeue=True))
    b.command(Abort(0, [1, 99], requeue=False))  # 99 is unknown: skipped
    ab = [x for x in drain(b) if x.kind == "trajectory_aborted"]
    assert [(x.req_id, x.data["requeue"]) for x in ab] == [(0, True), (1, False)]
    assert all(0 < x.data["tokens"] < 1000 for x in ab)
    assert not b.engines[0].running


def test_weights_loaded_under_running_requests_record_per_token_versions():
    c = cost(load_s=0.25)
    b = backend(c, [[400]])
    submit(b, [[400]])
    b.run_until(0.1)
    b.command(LoadWeights(0, 1))
    ev = drain(b)
    loaded = [x for x in ev if x.kind == "weights_loaded"]
    assert len(loaded) == 1 and loaded[0].t >= 0.1 + 0.25 and loaded[0].version == 1
    traj = [x.payload for x in ev if x.kind == "reward_scored"][0]
    runs = traj.versions.runs
    assert [v for v, _ in runs] == [0, 1] and sum(n for _, n in runs) == 400 and traj.version == 0
    assert finished(ev)[0].version == 0  # the oldest generating version


def test_a_weight_load_under_running_requests_costs_the_re_prefill_of_their_kv_and_counts_it_apart():
    """Partial rollout (AReaL): a load discards the running sequences' KV; each re-prefills prompt + tokens so far
    under the new weights, and only that recompute counts as `reprefill_s` (Laminar §2.3's re-prefill share)."""
    c = cost(prefill_s_per_token=1e-4, load_s=0.25)
    b = backend(c, [[400, 300]])
    submit(b, [[400, 300]])
    b.run_until(0.1)
    b.command(LoadWeights(0, 1))
    ev = drain(b)
    at_load = [t.payload.versions.runs[0][1] for t in ev if t.kind == "reward_scored"]   # tokens under version 0
    assert len(at_load) == 2 and all(0 < k < 300 for k in at_load)
    e = b.engines[0]
    # the siblings share the prompt's whole blocks: the second re-prefills only the prompt's partial block (0 here)
    assert e.reprefill_s == pytest.approx(c.prefill_s_per_token * (16 + sum(at_load)))
    assert b.reprefill_s == e.reprefill_s
    assert e.prefill_s_total == pytest.approx(c.prefill_s_per_token * 16 + e.reprefill_s)  # + the first prefill
    idle = backend(c, [[50]])                       # a load on an idle engine discards nothing
    idle.command(LoadWeights(0, 1))
    submit(idle, [[50]])
    drain(idle)
    assert idle.engines[0].reprefill_s == 0


def test_interrupt_hands_back_the_partial_and_a_resume_elsewhere_finishes_it_with_every_token():
    c = cost()
    b = backend(c, [[1000, 300]], engines=2)
    submit(b, [[1000, 300]])
    b.run_until(0.05)
    b.command(Interrupt(0, [0, 99]))             # 99 is unknown: skipped, no event
    ev = drain(b)
    part = [x for x in ev if x.kind == "trajectory_interrupted"]
    assert [x.req_id for x in part] == [0] and 0 < part[0].data["tokens"] < 1000
    partial = part[0].payload
    assert partial.finish_reason == "interrupted" and len(partial.response_ids) == part[0].data["tokens"]
    assert [x.req_id for x in finished(ev)] == [1]  # its sibling carried on
    b.engines[1].version = 3                        # resumed on a newer engine: the tail carries version 3
    b.submit(1, [Request(0, 0, 0, 0, 0, 16, partial=partial)], {0: PromptItem(0, RunList.of(1, 16), None)})
    done = [x.payload for x in drain(b) if x.kind == "reward_scored"]
    assert len(done) == 1 and len(done[0].response_ids) == 1000
    assert done[0].versions.runs == ((0, len(partial.response_ids)), (3, 1000 - len(partial.response_ids)))


def test_a_resumed_request_pays_the_re_prefill_of_its_tokens():
    c = cost(prefill_s_per_token=1e-3)
    times = {}
    for k in (0, 500):
        b = backend(c, [[600]])
        req = Request(0, 0, 0, 0, 0, 16)
        if k:
            req.partial = SimBackend.trajectory(0, replace(_sim_req(k), runs=[[0, k]]), "interrupted")
        b.submit(0, [req], {0: PromptItem(0, RunList.of(1, 16), None)})
        times[k] = finished(drain(b))[0].t
    # 500 tokens fewer to decode, but 500 more to prefill at 1 ms each: the resume is no free lunch
    assert times[500] > 0.5


def test_a_migrated_trajectory_moves_its_kv_and_an_interrupted_one_re_prefills():
    """An Interrupt with a destination (the controller's Migrate) resubmitted there: its prompt + tokens arrive at
    kv_move_s_per_token; without a rate, or back to the pending queue (dst -1), they are re-prefilled."""
    def resume_prefill(c: CostModel, dst: int, to: int) -> float:
        b = backend(c, [[5000]], engines=2)
        b.engines[1].version = 0
        submit(b, [[5000]])
        b.run_until(0.5)
        b.command(Interrupt(0, [0], dst))
        part = next(x for x in drain(b) if x.kind == "trajectory_interrupted").payload
        before = b.engines[to].prefill_s_total
        b.submit(to, [Request(0, 0, 0, 0, 0, 16, partial=part)], {0: PromptItem(0, RunList.of(1, 16), None)})
        b.run_until(b.now() + 1e-9)
        return (b.engines[to].prefill_s_total - before) / (16 + len(part.response_ids))
    fast = cost(prefill_s_per_token=1e-4, kv_move_s_per_token=1e-6)
    assert resume_prefill(fast, 1, 1) == pytest.approx(1e-6)       # migrated to engine 1: KV over the wire
    assert resume_prefill(fast, -1, 1) == pytest.approx(1e-4)      # interrupted, routed there later: recompute
    assert resume_prefill(fast, 1, 0) == pytest.approx(1e-4)       # resubmitted elsewhere than the migration said
    assert resume_prefill(cost(prefill_s_per_token=1e-4), 1, 1) == pytest.approx(1e-4)   # no rate: recompute


def _sim_req(done: int):
    from sim.engine import SimRequest
    return SimRequest(0, 0, 0, 0, 16, 600, 600, RunList.of(1, 16), done=done)


def test_migrate_never_reaches_a_backend():
    b = backend(cost(), [[10]], engines=2)
    with pytest.raises(TypeError, match="unknown backend command Migrate"):
        b.command(Migrate(0, 1, [0]))


def test_a_request_too_big_for_the_kv_pool_is_a_clear_error():
    b = backend(cost(kv_capacity_tokens=16 * 4), [[100]])
    with pytest.raises(ValueError, match="cannot fit in the KV pool"):
        submit(b, [[100]])


def test_runlist_behaves_like_the_list_it_stands_for():
    r = RunList([(0, 3), (1, 2)])
    assert r == [0, 0, 0, 1, 1] and len(r) == 5 and r[-1] == 1 and r[1:4] == [0, 0, 1] and min(r) == 0
    assert RunList.of(7, 0) == [] and math.isclose(sum(RunList.of(-1.0, 4)), -4.0)
    assert replace(cost(), name="x").name == "x"


def test_simulated_trajectories_share_one_fake_list_per_length_equal_to_its_own():
    a, b = fake_run(FAKE_TOKEN, 5), fake_run(FAKE_TOKEN, 5)
    assert a is b and a == RunList.of(FAKE_TOKEN, 5) == [FAKE_TOKEN] * 5
    assert fake_run(FAKE_LOGPROB, 5) == [FAKE_LOGPROB] * 5 and fake_run(FAKE_LOGPROB, 5) is not a
    assert fake_run(FAKE_TOKEN, 0) == [] and len(fake_run(FAKE_TOKEN, 3)) == 3
    with pytest.raises(ValueError, match="fake_run is for"):
        fake_run(3, 5)


def test_prefill_is_paid_once_when_a_plan_is_redone_at_the_same_instant():
    c = cost(prefill_s_per_token=1e-3)
    lens = [[50], [50]]
    prompts = {g: PromptItem(g, RunList.of(1, 64), None) for g in (0, 1)}
    reqs = [Request(g, g, 0, g, 0, 64) for g in (0, 1)]
    together = backend(c, lens, prompt_len=64)
    together.submit(0, reqs, prompts)
    split = backend(c, lens, prompt_len=64)
    split.submit(0, reqs[:1], prompts)
    split.submit(0, reqs[1:], prompts)  # same instant: the first plan is redone with both admitted
    t1 = [x.t for x in finished(drain(together))]
    t2 = [x.t for x in finished(drain(split))]
    assert t1 == pytest.approx(t2) and t1[0] == pytest.approx(c.prefill_s(128) + c.steps_s(2, 128, 50))


def test_an_overlapped_publication_frees_the_trainer_and_transfers_go_out_one_at_a_time():
    from rl.types import Group, Trajectory
    from sched.decisions import TrainCall
    c = cost(publish_s=5.0, train_s_per_token=1e-3)
    groups = [Group(0, 0, None, [Trajectory(0, 0, [1] * 10, [2] * 990, [-1.0] * 990, [0] * 990)])]
    for overlap in (False, True):
        b = backend(c, [[10]])
        b.train(TrainCall([0], step=True, publish=True, overlap_publish=overlap), groups)
        b.train(TrainCall([0], step=True, publish=True, overlap_publish=overlap), groups)
        ev = drain(b)
        done = [e.t for e in ev if e.kind == "train_step_done"]
        pub = [e.t for e in ev if e.kind == "version_published" and e.version > 0]
        step = done[0]                                         # one call's train time (1000 tokens)
        if overlap:   # the second call trains during the first transfer; its own waits for the first to end
            assert done[1] == pytest.approx(2 * step) and pub == pytest.approx([step + 5.0, step + 10.0])
        else:         # the trainer waits for each transfer
            assert done[1] == pytest.approx(2 * step + 5.0) and pub == pytest.approx([step + 5.0, 2 * step + 10.0])


@pytest.mark.parametrize("name,file", [("h100_qwen3_0p6b", "h100-2026-11-24.json"),
                                       ("h200_qwen3_0p6b", "h200-2026-11-27.json")])
def test_a_campaign_profile_comes_from_its_file_and_predicts_its_timed_decode_steps(name, file):
    """A measured profile's decode line (the whole engine run's decode bytes per second) must predict the 60
    decode steps the same campaign timed separately at batch 255 right after the prompts' prefill: their context
    lies between the prompts alone and every token processed by then. Each GPU campaign's file (H100: the first,
    2026-11-24; H200: the third, 2026-11-27, the engine with its fused kernels)."""
    import json

    from bench import engine as be
    from sim.profiles import QWEN3_0P6B, RESULTS_DIR

    p = PROFILES[name]
    data = json.loads((RESULTS_DIR / file).read_text())
    eng = data["sections"]["engine"]["results"]
    assert p.k1 == pytest.approx(QWEN3_0P6B.kv_bytes_per_token / (eng["decode_gbs"] * 1e9))
    assert p.kv_capacity_tokens == data["sections"]["grpo_step"]["results"]["kv_tokens"]
    assert all(v.startswith(("measured", "0:")) for k, v in p.sources.items() if k in ("k1", "k2", "k3", "k4"))
    ph = eng["phases_ms"]
    prompts, _ = be.workload(eng["prompts"], *eng["lengths"], be.SHAPES[eng["shape"]]["vocab_size"] - 1, 0)
    lo = sum(map(len, prompts))
    hi = ph["prefill_steps"] * 2048 + 60 * eng["prompts"]
    n = round(ph["mean_batch"])
    assert 0.9 * p.step_s(n, lo) <= ph["step"] / 1e3 <= 1.1 * p.step_s(n, hi), (p.step_s(n, lo), p.step_s(n, hi))


@settings(max_examples=200, deadline=None)
@given(bs=st.sampled_from([1, 2, 16, 32]), counts=st.lists(st.integers(0, 5), min_size=32, max_size=32),
       q_sum=st.integers(0, 50), steps=st.integers(0, 500), j=st.integers(0, 300))
def test_blocks_needed_in_closed_form_equal_the_sum_over_residues(bs, counts, q_sum, steps, j):
    """`SimEngine.need` (suffix sums of the residues' counts) against its definition, sum over the running requests'
    residues m of ceil((m + steps + j) / bs)."""
    b = backend(cost(block_size=bs), [[1]])
    e = b.engines[0]
    e._m_count, e._q_sum, e.steps, e._m_suffix = counts[:bs], q_sum, steps, None
    want = e.shared_blocks + q_sum + sum(c * -(-(m + steps + j) // bs) for m, c in enumerate(counts[:bs]) if c)
    assert e.need(j) == want


def test_a_runlist_pickles_as_its_runs_and_comes_back_equal_and_usable():
    import pickle
    r = RunList([(3, 2), (7, 4)])
    r[5]                                            # builds its index: not pickled
    back = pickle.loads(pickle.dumps(r))
    assert type(back) is RunList and back == r and back.runs == r.runs and len(back) == 6
    assert back.tolist() == [3, 3, 7, 7, 7, 7] and back[1] == 3 and back[-1] == 7
    assert pickle.loads(pickle.dumps(RunList.of(1, 0))) == []


def test_a_keep_kv_load_under_running_requests_re_prefills_nothing():
    """PipelineRL's in-flight update (LoadWeights.keep_kv): the same schedule as the test above, but the running
    sequences keep their KV: no re-prefill, their tokens so far stay version 0 and the rest are version 1, and they
    finish sooner than under the recomputing load by the re-prefill time."""
    c = cost(prefill_s_per_token=1e-4, load_s=0.25)
    ends = {}
    for keep in (False, True):
        b = backend(c, [[400, 300]])
        submit(b, [[400, 300]])
        b.run_until(0.1)
        b.command(LoadWeights(0, 1, keep_kv=keep))
        ev = drain(b)
        e = b.engines[0]
        runs = [t.payload.versions.runs for t in ev if t.kind == "reward_scored"]
        assert len(runs) == 2 and all([v for v, _ in r] == [0, 1] and 0 < r[0][1] for r in runs)
        assert sorted(sum(n for _, n in r) for r in runs) == [300, 400]
        ends[keep] = max(t.t for t in ev if t.kind == "trajectory_finished")
        if keep:
            assert e.reprefill_s == 0 and b.reprefill_s == 0
            assert e.prefill_s_total == pytest.approx(c.prefill_s_per_token * 16)   # the first prefill only
        else:
            assert e.reprefill_s > 0
    assert ends[True] < ends[False]

"""The functions that compute the reproduced figures (sim/repro/), on hand-built event logs, the recorded
calibration, and each paper's headline ordering in the simulator at a small scale."""
from types import SimpleNamespace

import pytest

from sched.events import Event
from sim.repro import figures
from sim.repro.rollpacker import round_max_len


def log(*rows):
    """Events from (kind, t, fields...) tuples."""
    return [Event(kind, t, **kw) for kind, t, kw in rows]


def result(events, samples=0, engines=1):
    return SimpleNamespace(events=events, metrics={"samples_trained": samples}, num_engines=engines, preset="x")


def two_rounds():
    """Round 0 at t=0: groups 0, 1 (requests 0-3; request 3 dropped), trained in two calls; round 1 at t=20."""
    return log(("round_started", 0.0, {"data": {"round": 0}}),
               ("trajectory_finished", 4.0, {"req_id": 0, "group_id": 0, "data": {"tokens": 40}}),
               ("trajectory_finished", 5.0, {"req_id": 1, "group_id": 0, "data": {"tokens": 50}}),
               ("reward_scored", 5.5, {"req_id": 0, "group_id": 0}),
               ("reward_scored", 6.0, {"req_id": 1, "group_id": 0}),
               ("group_materialized", 6.0, {"group_id": 0, "data": {"round": 0}}),
               ("train_started", 6.0, {"data": {"groups": [0], "step": False}}),
               ("train_step_done", 8.0, {"data": {"stepped": False, "samples": 2}}),
               ("trajectory_finished", 9.0, {"req_id": 2, "group_id": 1, "data": {"tokens": 90}}),
               ("trajectory_finished", 9.5, {"req_id": 3, "group_id": 1, "data": {"tokens": 95}}),
               ("trajectory_aborted", 9.5, {"req_id": 3, "group_id": 1}),
               ("reward_scored", 10.0, {"req_id": 2, "group_id": 1}),
               ("group_materialized", 10.0, {"group_id": 1, "data": {"round": 0}}),
               ("train_started", 10.0, {"data": {"groups": [1], "step": True}}),
               ("train_step_done", 12.0, {"data": {"stepped": True, "samples": 1}}),
               ("round_started", 20.0, {"data": {"round": 1}}),
               ("trajectory_finished", 23.0, {"req_id": 4, "group_id": 2, "data": {"tokens": 30}}),
               ("reward_scored", 23.0, {"req_id": 4, "group_id": 2}),
               ("group_materialized", 23.0, {"group_id": 2, "data": {"round": 1}}),
               ("train_started", 24.0, {"data": {"groups": [2], "step": True}}),
               ("train_step_done", 30.0, {"data": {"stepped": True, "samples": 1}}))


def test_round_figures_first_dispatch_step_and_shares():
    f = figures.round_figures(result(two_rounds()))
    assert f["first_dispatch_s"] == pytest.approx((6 + 4) / 2)       # round 0 at 6 s, round 1 at 24 - 20
    assert f["step_s"] == pytest.approx((12 + 10) / 2)               # to each round's last train call's end
    assert f["pre_train_share"] == pytest.approx((6 / 12 + 4 / 10) / 2)
    assert f["train_share"] == pytest.approx((4 / 12 + 6 / 10) / 2)


def test_round_rollout_and_max_length_count_only_kept_responses():
    ev = two_rounds()
    assert figures.round_rollout(result(ev)) == {0: pytest.approx(9.0), 1: pytest.approx(3.0)}   # 3 dropped
    assert round_max_len(result(ev)) == {0: 90, 1: 30}


def test_throughputs():
    r = result(two_rounds(), samples=4)
    assert figures.throughput(r) == pytest.approx(4 / 30)
    assert figures.after_warmup_throughput(r, 1) == pytest.approx(1 / (30 - 12))   # after the first step (t=12)
    assert figures.after_warmup_throughput(r, 0) == pytest.approx(4 / 30)
    with pytest.raises(RuntimeError, match="only 2 optimizer steps"):
        figures.after_warmup_throughput(r, 2)


def with_tokens(events):
    """two_rounds() with each train call's tokens and mean response length (prompt 10 tokens per sample)."""
    lens = iter([(2, 45.0), (1, 90.0), (1, 30.0)])
    for e in events:
        if e.kind == "train_step_done":
            n, mean = next(lens)
            e.data.update(tokens=n * (10 + mean), response_len_mean=mean)
    return events


def test_token_throughputs_count_trained_tokens_not_samples():
    r = result(with_tokens(two_rounds()), samples=4)
    assert figures.throughput(r, "tokens") == pytest.approx((110 + 100 + 40) / 30)
    assert figures.after_warmup_throughput(r, 1, "tokens") == pytest.approx(40 / (30 - 12))
    with pytest.raises(ValueError, match="unit must be one of"):
        figures.throughput(r, "requests")


def test_length_bias_compares_trained_with_generated_lengths_and_reports_the_backlog():
    r = result(with_tokens(two_rounds()), samples=4)
    r.metrics.update(backlog_groups=2, in_flight=7)
    b = figures.length_bias(r)
    assert b["trained_len"] == pytest.approx((90 + 90 + 30) / 4)         # 2 x 45, 90, 30 over 4 samples
    assert b["generated_len"] == pytest.approx((40 + 50 + 90 + 95 + 30) / 5)   # the dropped one was generated too
    assert b["bias"] == pytest.approx(b["trained_len"] / b["generated_len"])
    assert b["overgeneration"] == pytest.approx(5 / 4)
    assert (b["backlog_groups"], b["in_flight"]) == (2, 7)


def test_rollout_idle_ratio_and_generation_rate():
    ev = log(("round_started", 0.0, {"data": {"round": 0}}), ("engine_busy", 0.0, {"engine": 0}),
             ("engine_idle", 6.0, {"engine": 0}), ("engine_busy", 0.0, {"engine": 1}),
             ("engine_idle", 8.0, {"engine": 1}), ("tokens_decoded", 8.0, {"engine": 0, "data": {"total": 300}}),
             ("tokens_decoded", 8.0, {"engine": 1, "data": {"total": 500}}),
             ("train_started", 8.0, {"data": {"groups": []}}), ("train_step_done", 10.0, {"data": {}}))
    r = result(ev, engines=2)
    assert figures.rollout_idle_ratio(r) == pytest.approx((2 + 0) / (2 * 10))   # engine 0 idle 6-8 of 0-8
    assert figures.generation_tps(r) == pytest.approx(800 / 10)


def test_reprefill_share_is_the_load_recompute_over_the_engines_busy_time():
    ev = log(("engine_busy", 0.0, {"engine": 0}), ("engine_idle", 6.0, {"engine": 0}),
             ("engine_busy", 2.0, {"engine": 1}), ("engine_idle", 4.0, {"engine": 1}),
             ("engine_busy", 7.0, {"engine": 1}), ("train_step_done", 10.0, {"data": {}}))   # engine 1 busy to the end
    r = result(ev, engines=2)
    r.metrics["reprefill_s"] = 2.2
    assert figures.reprefill_share(r) == pytest.approx(2.2 / (6 + 2 + 3))


def test_the_recorded_rollpacker_training_speed_is_the_calibration():
    """ROLLPACKER_TRAIN_MFU is what calibrate_train_mfu gives (Table 1's 22% training share for veRL 14B/16k)."""
    from sim.profiles import ROLLPACKER_TRAIN_MFU
    from sim.repro.rollpacker import calibrate_train_mfu
    assert calibrate_train_mfu((0,)) == pytest.approx(ROLLPACKER_TRAIN_MFU, rel=0.05)


# ------------------------------------------------------------------------------------- headline orderings
def test_rolloutpipe_headline_cgp_trains_before_the_barrier_and_shortens_the_round():
    from sim.repro import Runs, Setting
    from sim.repro.rolloutpipe import CGP_ONLY
    s = Setting("rolloutpipe", "rolloutpipe_qwen3_1p7b", 1, 8, 16, 8, 2)
    runs = Runs(0)
    slime, cgp = (figures.round_figures(runs.get(*x)) for x in (("slime", s), ("rolloutpipe", s, CGP_ONLY)))
    assert cgp["first_dispatch_s"] < 0.5 * slime["first_dispatch_s"]
    assert cgp["step_s"] < 0.9 * slime["step_s"]


def test_rolloutpipe_frontier_first_is_fifo_in_our_engine_and_the_cap_is_not():
    """FGD read as frontier-first order over FIFO (mode "first") admits everything FIFO does in the same order, so
    on our engine (admission in submission order) its rounds are CGP's to the event; the hard cap is not."""
    from sim.repro import Runs, Setting
    from sim.repro.rolloutpipe import CAP, CGP_ONLY, FIRST
    s = Setting("rolloutpipe", "rolloutpipe_qwen3_1p7b", 1, 8, 16, 8, 2)
    runs = Runs(0)
    first, fifo, cap = (runs.get("rolloutpipe", s, o) for o in (FIRST, CGP_ONLY, CAP))
    assert [(e.kind, e.t) for e in first.events] == [(e.kind, e.t) for e in fifo.events]
    assert figures.mean_batch(cap) <= 16 < figures.mean_batch(first)


def test_rollpacker_headline_short_rounds_are_shorter_and_the_run_faster():
    from sim.repro import Runs, Setting
    from sim.repro.rollpacker import ROUND_END
    base = dict(workload="rollpacker_7b_8k", cost="h800_7b", num_engines=4, train_gpus=4, prompts=32, group_size=8,
                rounds=5, colocated=True)
    verl = Setting(**base, sim=(("reward_workers", 64), ("reward_stage", True)))
    packer = Setting(**base, sim=(("reward_workers", 64), ("adaptive_timeout", True)))
    runs = Runs(0)
    v, p = runs.get("sync", verl), runs.get("rollpacker", packer, ROUND_END)
    kinds = {e.data["round"]: e.data["kind"] for e in p.events if e.kind == "round_started"}
    short = [t for rd, t in figures.round_rollout(p).items() if kinds[rd] == "short"]
    assert max(short) < min(figures.round_rollout(v).values())
    assert figures.throughput(p) > 1.2 * figures.throughput(v)


def test_streamrl_ranker_recall_and_scale_out_iterations():
    from sim.repro import Runs
    from sim.repro.streamrl import first_scale_out, recall_by_round, scale_outs
    # round 1: groups 10..14 with true lengths 50, 40, 30, 20, 10; the ranker put 12 first, then 10. Read from the
    # events' own fields, as a pooled result carries them (no payloads)
    ranked = {10: 5.0, 11: 1.0, 12: 9.0, 13: 2.0, 14: 0.0}
    lens = {10: 50, 11: 40, 12: 30, 13: 20, 14: 10}
    ev = [Event("group_materialized", 0.0, group_id=g, data={"round": 1 if g >= 10 else 0}) for g in (3, *lens)]
    ev += [Event("trajectory_finished", 1.0, group_id=g, data={"tokens": n})
           for g, n in [(3, 99), *lens.items()]]                  # round 0 (group 3) is the ranker's warm-up
    r = SimpleNamespace(events=ev, policy=SimpleNamespace(dispatch=SimpleNamespace(ranked={3: 0.0, **ranked})))
    assert recall_by_round(r, 0.2, first=1) == [0.0]              # top 1 of 5: predicted 12, true 10
    assert recall_by_round(r, 0.4, first=1) == [0.5]              # top 2: {12, 10} vs {10, 11}
    assert recall_by_round(r, 0.2) == [1.0, 0.0]                  # every round: round 0's one group first
    steps = [Event("train_step_done", t, data={"stepped": True}) for t in (10.0, 20.0, 30.0)]
    added = [Event("engines_added", t, data={"engines": [9]}) for t in (20.0, 25.0)]
    runs = Runs(0)
    runs.cache["fig11"] = SimpleNamespace(events=sorted(steps + added, key=lambda e: e.t))
    assert scale_outs(runs) == 2.0 and first_scale_out(runs) == 2.0   # after the step at t=20 (same instant) and t=25
    runs.cache["fig11"] = SimpleNamespace(events=steps)
    assert scale_outs(runs) == 0.0 and first_scale_out(runs) != first_scale_out(runs)   # none: nan, a miss


@pytest.mark.parametrize("gen_busy,train_s,expected", [
    (0.95, 61.0, 112),     # generation-bound (380 s of work against 61 s): x = 110.3, to a node
    (0.02, 400.0, 8),      # trainer-bound: x = 2.5, kept at one node
    (0.50, 200.0, 64),     # balanced already: the even split stays
])
def test_staleflow_balanced_split_divides_the_gpus_in_proportion_to_each_stages_work(monkeypatch, gen_busy,
                                                                                       train_s, expected):
    from sim.repro import staleflow
    from sim.repro.core import Runs
    seen = []

    def fake_run(runs, preset, s, eta, per_engine=None):
        seen.append((preset, s, eta))
        return SimpleNamespace(metrics={"makespan_s": 400.0, "engine_idle_ratio": 1.0 - gen_busy,
                                        "train_compute_s": train_s})
    monkeypatch.setattr(staleflow, "sf_run", fake_run)
    runs = Runs(0)
    s = staleflow.balanced(runs, "areal", 2)
    # W_gen = 64 x 400 x busy, W_train = 64 x train_s; x = 128 W_gen / (W_gen + W_train), to a node, in [8, 120]
    assert (s.num_engines, s.train_gpus) == (expected, 128 - expected)
    assert seen == [("areal", staleflow.SF, 2)]              # measured once, at the even split, and memoised
    assert staleflow.balanced(runs, "areal", 2) is s and len(seen) == 1


@pytest.mark.parametrize("faster", ["even", "balanced"])
def test_staleflow_tuned_split_takes_whichever_candidate_ran_faster(monkeypatch, faster):
    from sim.repro import staleflow
    from sim.repro.core import Runs

    def fake_run(runs, preset, s, eta, per_engine=None):   # generation-bound at the even split: the balance says 112 rollout GPUs
        return SimpleNamespace(metrics={"makespan_s": 400.0, "engine_idle_ratio": 0.05, "train_compute_s": 61.0},
                               gpus=s.num_engines)
    speed = {64: 1.0, 112: 1.3 if faster == "balanced" else 0.8}
    monkeypatch.setattr(staleflow, "tokens_per_s", lambda r: speed[r.gpus])
    seen = []
    monkeypatch.setattr(staleflow, "sf_run", lambda runs, preset, s, eta, per_engine=None:
                        seen.append((runs.seed, s.num_engines)) or fake_run(runs, preset, s, eta))
    first = Runs(0)
    s = staleflow.tuned_split(first, "one_step", None)
    assert s.num_engines == (112 if faster == "balanced" else 64) and s.num_engines + s.train_gpus == 128
    assert staleflow.tuned_split(Runs(1, first), "one_step", None) is s    # chosen once, on the first seed
    assert [x for x in seen if x[0] == 1] == [(1, 64)]          # another seed runs only its even split, up front

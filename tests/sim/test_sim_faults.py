"""Engine faults in the simulator (Laminar §3.3, §8.5; sim/backend.py `EngineFault`): a killed engine loses only what
its requests generated since their last stream to the partial-response pool, its trajectories resume on the others,
it comes back empty and without weights, loads the latest version and takes work again; nothing is lost or trained
twice. Bad fault plans are named before anything runs."""
from __future__ import annotations

import pytest

from sim import simulate
from sim.backend import EngineFault
from sim.repro.laminar_faults import check_nothing_lost, decoded_between, figures, step_ends

RUN = dict(workload="rollpacker_7b_8k", cost="h800_7b", num_engines=4, train_gpus=4, steps=6, group_size=8,
           prompts_per_step=32, seed=0, counters_every_s=1.0)
KILL, DOWN = 6.5, 30.0     # not on a counters tick: the runs are identical until the kill


def run(faults=(), stream_every_s: float = 2.0, preset: str = "laminar", **kw):
    return simulate(preset, **{**RUN, **kw}, faults=faults, stream_every_s=stream_every_s)


@pytest.fixture(scope="module")
def pair():
    return run(), run((EngineFault(KILL, (0, 1), DOWN),))


def test_a_killed_engine_loses_only_what_was_not_streamed_and_its_work_resumes_elsewhere(pair):
    ref, hit = pair
    failed = [e for e in hit.events if e.kind == "engine_failed"]
    assert sorted(e.engine for e in failed) == [0, 1] and all(abs(e.t - KILL) < 0.2 for e in failed)
    held = {e.engine: e.data["held"] for e in failed}
    assert all(held.values()), "the engines held nothing when killed: the test kills too late"
    rec = {e.engine: e.data for e in hit.events if e.kind == "trajectories_recovered"}
    for engine, d in rec.items():
        h = held[engine]
        assert d["resumed"] == len(h) and d["tokens_kept"] + d["tokens_lost"] == sum(h.values())
        assert d["dropped"] == 0
    kept, lost = sum(d["tokens_kept"] for d in rec.values()), sum(d["tokens_lost"] for d in rec.values())
    assert kept > 0 and lost > 0
    # what was lost is bounded by the stream period: at most one token per engine step since the last stream (2 s)
    step_s = min(hit.backend.cost.steps_s(1, 0, 1), 1.0)
    assert lost <= sum(len(h) for h in held.values()) * 2.0 / step_s
    # the resumed trajectories went to the healthy engines while 0 and 1 were down
    down = [e for e in hit.events if e.kind == "trajectory_finished" and KILL < e.t < KILL + DOWN]
    assert down and {e.engine for e in down} <= {2, 3}
    check_nothing_lost(hit)
    assert hit.metrics["samples_trained"] == ref.metrics["samples_trained"]
    assert hit.metrics["engine_failures"] == 2 and hit.metrics["failed_engine_resumed"] == sum(len(h) for h in
                                                                                               held.values())


def test_a_killed_engine_comes_back_empty_without_weights_then_loads_the_latest_and_decodes(pair):
    _, hit = pair
    for engine in (0, 1):
        ev = [e for e in hit.events if e.engine == engine and e.t >= KILL - 0.2]
        kinds = [e.kind for e in ev]
        i, j = kinds.index("engine_failed"), kinds.index("engine_recovered")
        assert abs(ev[j].t - ev[i].t - DOWN) < 1e-6 and ev[j].version == -1 and ev[j].data["down_s"] == DOWN
        between = set(kinds[i + 1:j]) & {"engine_busy", "tokens_decoded", "trajectory_finished", "weights_loaded",
                                         "trajectory_interrupted", "trajectory_aborted"}
        assert not between, f"engine {engine} did something while dead: {between}"
        k = kinds.index("weights_loaded", j)
        latest = max(e.version for e in hit.events if e.kind == "version_published" and e.t <= ev[k].t)
        assert ev[k].version == latest
        assert "engine_busy" in kinds[k:], f"engine {engine} never decoded again"


def test_the_outage_shows_in_the_generation_rate_and_the_figures_read_it(pair):
    ref, hit = pair
    assert decoded_between(hit, KILL, KILL + DOWN) < decoded_between(ref, KILL, KILL + DOWN)
    assert len(step_ends(hit)) == len(step_ends(ref)) == 6
    f = figures(ref, hit, KILL, DOWN)
    assert f.resumed == hit.metrics["failed_engine_resumed"] and f.samples == (6 * 32 * 8, 6 * 32 * 8)
    assert [w[:3] for w in f.windows] == [("before the kill", KILL - DOWN, KILL), ("outage", KILL, KILL + DOWN),
                                          ("after recovery", KILL + DOWN, KILL + 2 * DOWN)]
    assert f.windows[0][3] == f.windows[0][4] and f.windows[1][3] < f.windows[1][4]   # identical until the kill
    assert DOWN < f.back_decoding_s < DOWN + 10 and f.tokens_lost > 0


def test_streaming_more_often_loses_less():
    lost = {}
    for every in (1.0, 4.0):
        r = run((EngineFault(KILL, (0,), DOWN),), stream_every_s=every)
        lost[every] = sum(e.data["tokens_lost"] for e in r.events if e.kind == "trajectories_recovered")
    assert lost[1.0] < lost[4.0]


def test_nothing_lost_catches_a_lost_trajectory_and_a_group_trained_twice(pair):
    _, hit = pair
    check_nothing_lost(hit)

    def doctored(events):
        out = type(hit).__new__(type(hit))
        out.__dict__.update(hit.__dict__, events=events)
        return out
    first = next(e for e in hit.events if e.kind == "train_started")
    with pytest.raises(AssertionError, match=r"groups trained twice \[\d"):
        check_nothing_lost(doctored([first] + list(hit.events)))
    rid = int(next(iter(next(e for e in hit.events if e.kind == "engine_failed").data["held"])))
    with pytest.raises(AssertionError, match=rf"never finished \[{rid}\]"):
        check_nothing_lost(doctored([e for e in hit.events if not (e.kind == "trajectory_finished"
                                                                   and e.req_id == rid)]))


@pytest.mark.parametrize("kw,match", [
    (dict(faults=(EngineFault(5.0, (0,), 10.0),), counters_every_s=None), "need counters_every_s"),
    (dict(faults=(EngineFault(5.0, (7,), 10.0),)), r"engines among 0\.\.3"),
    (dict(faults=(EngineFault(-1.0, (0,), 10.0),)), "at_s >= 0"),
    (dict(faults=(EngineFault(5.0, (0,), 10.0),), stream_every_s=2.5), "whole multiple of counters_every_s"),
    (dict(faults=(EngineFault(5.0, (0,), 10.0),), preset="sync"), "no mechanism isolates engine faults"),
    (dict(faults=tuple(EngineFault(5.0 * k, (0,), 1.0) for k in range(1, 5))), "fail an engine 4 times"),
])
def test_a_bad_fault_plan_is_named_before_anything_runs(kw, match):
    with pytest.raises(ValueError, match=match):
        run(**{"stream_every_s": 2.0, **kw})


def test_an_engine_killed_for_good_is_retired_and_the_run_finishes_on_the_others():
    r = run((EngineFault(KILL, (3,), float("inf")),))
    assert r.metrics["engines_retired"] == 1 and not any(e.kind == "engine_recovered" for e in r.events)
    assert not any(e.engine == 3 and e.kind == "engine_busy" and e.t > KILL for e in r.events)
    check_nothing_lost(r)
    assert r.metrics["samples_trained"] == 6 * 32 * 8


@pytest.mark.parametrize("cost,train_gpus", [("h800_7b", 4), ("h800_laminar_32b", 16)])   # re-prefill / KV moves
def test_random_fault_plans_with_repack_lose_nothing(cost, train_gpus):
    """Adversarial schedules: up to five kills of 1-3 of the 4 engines at random times, outages from 0.5 s to a
    minute, streams every 1-5 s, while repack moves trajectories between the engines (re-prefilled, or their KV
    moved over the interconnect): every run trains all its samples, none lost, none twice."""
    import random
    for trial in range(3):
        rng = random.Random(trial)
        faults, kills = [], dict.fromkeys(range(4), 0)
        for _ in range(rng.randint(2, 5)):
            engines = tuple(sorted(rng.sample(range(4), rng.randint(1, 3))))
            if all(kills[i] < 3 for i in engines):   # the preset's engine_failures
                kills.update((i, kills[i] + 1) for i in engines)
                faults.append(EngineFault(rng.uniform(0, 200), engines, rng.choice([0.5, 3.0, 20.0, 60.0])))
        r = run(tuple(faults), stream_every_s=rng.choice([1.0, 2.0, 5.0]), cost=cost, train_gpus=train_gpus, steps=8,
                seed=rng.randint(0, 5))
        check_nothing_lost(r)
        # a kill of an engine already down, or after the run's end, does not fire
        assert r.metrics["samples_trained"] == 8 * 32 * 8 and 1 <= r.metrics["engine_failures"] <= sum(kills.values())
        assert r.metrics["policy_stats"]["rebalance"]["moves"] > 0


def test_the_laminar_faults_command_runs_end_to_end_on_a_small_setting(monkeypatch, capsys):
    """`python -m sim.repro.laminar_faults` on a small stand-in for the reproduction's setting: the kill lands at the
    end of the fault-free run's 4th iteration, the table and the last line come out, bad options are named."""
    from sim.repro import laminar_faults
    from sim.repro.core import Setting
    small = Setting("rollpacker_7b_8k", "h800_7b", 4, 4, 32, 8, 8)
    monkeypatch.setattr(laminar_faults, "LAMINAR_RUN", ("laminar", small, ()))
    monkeypatch.setattr(laminar_faults, "RECOVERY_S", 30.0)
    assert laminar_faults.main(["--seed", "1", "--stream-every", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "(end of iteration 4), back after 30 s" in out[0] and "streamed every 2 s" in out[0]
    assert [line.split(" | ")[0] for line in out[2:5]] == ["before the kill", "outage", "after recovery"]
    assert out[-1].startswith("laminar §8.5: training throughput under a machine kill ")
    for bad, named in ((["--train-speed", "0"], "--train-speed must be > 0"),
                       (["--stream-every", "2.5"], "--stream-every must be a whole number of seconds >= 1")):
        with pytest.raises(SystemExit):
            laminar_faults.main(bad)
        assert named in capsys.readouterr().err

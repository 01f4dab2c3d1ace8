"""The Laminar reproduction's placement rule (§8.1), its trainer-bound criterion and its idle figures, on hand-built
runs and event logs."""
from types import SimpleNamespace

import pytest

from sched.events import Event
from sim.repro import laminar as L
from sim.repro.core import ARITHMETIC, BOUND, Runs
from sim.repro.placement import balanced_split, per_sample_balanced_split


def finished(n, t=1.0):
    return [Event("trajectory_finished", t, data={"tokens": 10}) for _ in range(n)]


def run(engines, train_gpus, busy, train_s, trained, generated, makespan=400.0):
    return SimpleNamespace(metrics={"makespan_s": makespan, "engine_idle_ratio": 1.0 - busy,
                                    "train_compute_s": train_s, "samples_trained": trained},
                           events=finished(generated), num_engines=engines, train_gpus=train_gpus, preset="x")


def test_per_sample_split_is_balanced_split_when_every_generated_sample_is_trained():
    r = run(16, 64, 0.9, 300.0, trained=1000, generated=1000)
    assert per_sample_balanced_split(r, L.LM_EVEN, 128, 8, 4) == balanced_split(r, L.LM_EVEN, 128, 8, 4)


def test_per_sample_split_does_not_count_over_generation_as_work_the_trainer_needs():
    # both stages always busy at 64 + 64, but the engines generate twice what the trainer takes: balanced_split reads
    # that as balance, the per-sample rule gives a third of the GPUs to generation (128 / 3 = 42.7, to a machine: 40)
    r = run(16, 64, 1.0, 400.0, trained=1000, generated=2000)
    assert balanced_split(r, L.LM_EVEN, 128, 8, 4) == L.LM_EVEN
    s = per_sample_balanced_split(r, L.LM_EVEN, 128, 8, 4)
    assert (s.num_engines * 4, s.train_gpus) == (40, 88)
    with pytest.raises(ValueError):
        per_sample_balanced_split(r, L.LM_EVEN, 128, 6, 4)          # a machine of whole engines only


@pytest.mark.parametrize("faster", ["start", "balanced"])
def test_lm_split_keeps_the_faster_of_table_2_and_the_balance_once_for_every_seed(monkeypatch, faster):
    seen = []

    def fake_get(runs, preset, s, overrides=()):
        seen.append((runs.seed, preset, s.num_engines))
        return run(s.num_engines, s.train_gpus, 1.0, 400.0, trained=1000, generated=2000)
    speed = {16: 1.0, 10: 1.2 if faster == "balanced" else 0.9}
    monkeypatch.setattr(L, "lm_get", fake_get)
    monkeypatch.setattr(L, "steady_throughput", lambda r: speed[r.num_engines])
    first = Runs(0)
    s = L.lm_split(first, "laminar")
    assert s.num_engines == (10 if faster == "balanced" else 16) and s.num_engines * 4 + s.train_gpus == 128
    assert L.lm_split(Runs(1, first), "laminar") is s            # chosen on the first seed, kept
    assert {x for x in seen if x[0] == 1} == set()                  # another seed's runs are not read to choose
    assert L.lm_system("laminar")(Runs(2, first)).num_engines == s.num_engines


def log(*rows):
    return [Event(kind, t, engine=eng, data=data) for kind, t, eng, data in rows]


def steps(*ends, length=1.0, samples=10):
    out = []
    for t in ends:
        out += [("train_started", t - length, -1, {}), ("train_step_done", t, -1, {"stepped": True,
                                                                                     "samples": samples})]
    return out


def fake(events, engines=1, train_gpus=8, idle=0.0, trained=30):
    return SimpleNamespace(events=sorted(events, key=lambda e: e.t), num_engines=engines, train_gpus=train_gpus,
                           metrics={"engine_idle_ratio": idle, "samples_trained": trained}, preset="x")


def test_trainer_bound_needs_a_busy_trainer_and_engines_with_headroom():
    busy_engine = [("engine_busy", 0.0, 0, {}), ("engine_idle", 100.0, 0, {})]
    # window from step 2's end (t=20) to step 4's end (t=40): trained 20 samples there
    bound = fake(log(*steps(10, 20, 30, 40, length=10.0), *busy_engine,
                     *[("trajectory_finished", 25.0, 0, {})] * 30))
    assert L.trainer_idle_share(bound) == pytest.approx(0.0)
    assert L.generation_headroom(bound) == pytest.approx(30 / 20 - 1)
    assert L.trainer_bound(bound)
    waits = fake(log(*steps(10, 20, 30, 40, length=5.0), *busy_engine, *[("trajectory_finished", 25.0, 0, {})] * 30))
    assert L.trainer_idle_share(waits) == pytest.approx(0.5) and not L.trainer_bound(waits)
    balanced = fake(log(*steps(10, 20, 30, 40, length=10.0), *busy_engine,
                        *[("trajectory_finished", 25.0, 0, {})] * 20))
    assert L.generation_headroom(balanced) == pytest.approx(0.0) and not L.trainer_bound(balanced)


def test_a_comparison_is_caveated_only_when_both_systems_are_trainer_bound(monkeypatch):
    state = {"laminar": True, "one_step": True}
    monkeypatch.setattr(L, "lm_system", lambda name: lambda runs: name)
    monkeypatch.setattr(L, "steady_throughput", lambda r: {"laminar": 2.0, "one_step": 1.0}[r])
    monkeypatch.setattr(L, "trainer_bound", lambda r: state[r])
    row = next(r for r in L.LAMINAR if r.figure.startswith("Laminar vs one-step"))
    try:
        assert row.compute(Runs(0)) == 2.0 and row.caveat == L.TRAINER_BOUND_CAVEAT
        state["one_step"] = False
        assert row.compute(Runs(0)) == 2.0 and row.caveat == ""
    finally:
        row.caveat = ""


def test_gpu_idle_share_counts_idle_engines_and_an_idle_trainer_after_the_first_step():
    # 1 engine of 8 GPUs busy half of the window [10, 30]; 8 train GPUs training 10 s of it
    ev = log(*steps(10, 20, 30, length=5.0), ("engine_busy", 0.0, 0, {}), ("engine_idle", 20.0, 0, {}))
    r = fake(ev, engines=1, train_gpus=8)
    assert L.gpu_idle_share(r, 8) == pytest.approx((10 * 8 + 10 * 8) / (16 * 20))


def test_the_relay_row_is_arithmetic_and_the_staleness_row_a_bound():
    kinds = {r.figure.split(",")[0]: r.kind for r in L.LAMINAR}
    assert kinds["relay broadcast"] == ARITHMETIC and kinds["max staleness"] == BOUND

"""The reproductions' pool (sim/repro/core.py `evaluate`): simulations run in worker processes and come back pickled
(SimResult's packed events), giving the same rows as one process; a run chosen from another run's figures is asked for
once that run is back; each row is computed once; a failing simulation is that row's error, not the command's; a
hung pool ends at its deadline with a named error."""
import pickle
import time

import pytest

import sim.repro
from sim.repro import core
from sim.repro.core import Paper, Row, Runs, Setting, evaluate, gather
from sim.run import simulate

TINY = Setting("cpu_tiny", "cpu_tiny", 2, 2, 4, 4, 3)
WIDE = Setting("cpu_tiny", "cpu_tiny", 3, 2, 4, 4, 3)
BAD = (("dispatch", (("no_such_key", 1),)),)     # sync's dispatch takes no parameters: load_preset raises


def _makespan(r) -> float:
    return r.metrics["makespan_s"]


def _chosen(runs: Runs) -> float:
    """A run on a setting chosen from another run's figures (as StaleFlow's tuned split): two waves."""
    s = runs.memo("pick", lambda: WIDE if _makespan(runs.get("one_step", TINY)) > 0 else TINY)
    return _makespan(runs.get("staleflow", s))


def _three(runs: Runs) -> float:
    a, b, c = gather([lambda: runs.get("sync", TINY), lambda: runs.get("one_step", TINY),
                      lambda: runs.get("sync", WIDE)])
    return _makespan(a) + _makespan(b) + _makespan(c)


FAKE = Paper([Row("a", (1, 1), "1", lambda runs: _makespan(runs.get("sync", TINY))),
              Row("b", (1, 1), "1", _chosen),
              Row("c", (1, 1), "1", _three),
              Row("d", (1, 1), "1", lambda runs: _makespan(runs.get("sync", TINY, BAD)))],
             notes=[lambda runs: f"note {_makespan(runs.get('one_step', WIDE)):.3f}"])


def test_a_pickled_result_keeps_every_logged_field_of_every_event():
    r = simulate("staleflow", "cpu_tiny", "cpu_tiny", 2, 2, steps=3, group_size=4, prompts_per_step=4)
    back = pickle.loads(pickle.dumps(r))
    assert [e.to_json() for e in back.events] == [e.to_json() for e in r.events] and back.events == r.events
    assert all(e.payload is None for e in back.events) and back.metrics == r.metrics
    assert back.views.in_flight() == r.views.in_flight() and back.views.now == r.views.now
    assert back.policy.dispatch.name == r.policy.dispatch.name
    assert back.policy.handoff.state_dict() == r.policy.handoff.state_dict()


def test_an_unpickled_result_builds_only_the_kinds_read_and_the_whole_log_when_asked():
    r = simulate("staleflow", "cpu_tiny", "cpu_tiny", 2, 2, steps=3, group_size=4, prompts_per_step=4)
    back = pickle.loads(pickle.dumps(r))
    kinds = ("train_step_done", "trajectory_finished")
    assert "events" not in vars(back)                        # still packed
    assert back.of(*kinds) == r.of(*kinds) and back.of(*kinds) and back.end_t == r.end_t
    packed = vars(back)["_packed"]
    made = {packed.kinds[k] for k in packed._made}
    assert made == set(kinds) and len(packed.kinds) > len(kinds)   # the other kinds' blobs are still bytes
    assert back.of("nothing_logged") == []
    again = pickle.loads(pickle.dumps(back))                 # re-pickled from its columns
    assert "events" not in vars(back) and again.events == r.events
    assert back.events == r.events and back.of(*kinds) == r.of(*kinds)    # the whole list, once read


def test_a_result_shipped_with_some_kinds_gives_those_and_refuses_the_others_by_name():
    r = simulate("staleflow", "cpu_tiny", "cpu_tiny", 2, 2, steps=3, group_size=4, prompts_per_step=4)
    kinds = ("train_started", "train_step_done")
    full = r.of(*kinds)
    r.ship_only(frozenset(kinds))
    back = pickle.loads(pickle.dumps(r))
    assert back.of(*kinds) == full and back.of("train_step_done") == r.of("train_step_done") and full
    assert back.end_t == max(e.t for e in r.events)         # the whole log's end, not the shipped kinds'
    assert len(pickle.dumps(back)) < len(pickle.dumps(pickle.loads(pickle.dumps(simulate(
        "staleflow", "cpu_tiny", "cpu_tiny", 2, 2, steps=3, group_size=4, prompts_per_step=4)))))
    for res in (r, back):                                    # in this process and wherever it is unpickled
        with pytest.raises(KeyError, match=r"\['reward_scored'\].*reads_kinds"):
            res.of("reward_scored", "train_started")
    with pytest.raises(AttributeError, match="carries only"):
        back.events


def test_a_row_reading_a_kind_its_paper_does_not_name_fails_with_that_kind_in_the_pool(monkeypatch):
    def finished(runs: Runs) -> float:
        return float(len(runs.get("sync", TINY).of("trajectory_finished")))

    paper = Paper([Row("n", (1, 1), "1", finished),
                   Row("t", (1, 1), "1", lambda runs: float(len(runs.get("sync", TINY).of("train_step_done"))))],
                  reads_kinds=frozenset({"train_step_done"}))
    monkeypatch.setitem(sim.repro.PAPERS, "fake_kinds", paper)
    for jobs in (1, 2):
        (n, t), _ = evaluate("fake_kinds", [0], jobs)
        assert "trajectory_finished" in n[0] and "reads_kinds" in n[0], n
        assert t[0] == 3.0


def test_a_pooled_result_travels_without_its_views_and_its_metrics_carry_the_backlog():
    spec = core.SimSpec("staleflow", (), Setting("cpu_tiny", "cpu_tiny", 2, 2, 4, 4, 2), 0)
    whole = spec.run()
    back, r, seconds = core._run_spec((spec, core.Sensitivity(), True, None))
    assert back == spec and seconds > 0 and r.views is None and r.policy is not None
    assert (r.metrics["backlog_groups"], r.metrics["in_flight"]) == (len(whole.views.ready_groups()),
                                                                    whole.views.in_flight())
    assert r.metrics["in_flight"] > 0, "nothing was left in flight: the check above is vacuous"


def test_the_pool_gives_the_rows_and_notes_one_process_gives_asking_for_runs_as_the_rows_read_them(monkeypatch):
    monkeypatch.setitem(sim.repro.PAPERS, "fake", FAKE)
    asks, have = [], []
    ask = core._ask

    def recording(all_runs, task):
        have.append({(s.preset, s.setting.num_engines, s.seed) for runs in all_runs for s in runs.cache
                     if isinstance(s, core.SimSpec)})
        out = ask(all_runs, task)
        asks.append({(s.preset, s.setting.num_engines, s.seed) for s in out})
        return out
    monkeypatch.setattr(core, "_ask", recording)
    pooled = evaluate("fake", [0, 1], jobs=2)
    first = len(core._tasks(FAKE, [Runs(0), Runs(1)]))
    assert len(asks) > first and not asks[-1]             # asked again as runs came back, until nothing is missing
    chosen = next(i for i, a in enumerate(asks) if ("staleflow", 3, 0) in a)
    assert chosen >= first and ("one_step", 2, 0) in have[chosen]   # the chosen setting's run waits for its source
    assert ("sync", 3, 1) in set().union(*asks[:first])
    assert not any(("one_step", 3, 1) in a for a in asks)   # notes: first seed only
    monkeypatch.setattr(core, "_ask", ask)
    alone = evaluate("fake", [0, 1], jobs=1)
    assert pooled == alone
    per_row, notes = pooled
    assert all(isinstance(v, float) and v > 0 for row in per_row[:3] for v in row)
    assert all(v.startswith("failed: ValueError") and "no_such_key" in v for v in per_row[3])
    assert len(notes) == 1 and notes[0].startswith("note ")


def test_a_hung_pool_ends_at_its_deadline_with_a_named_error(monkeypatch):
    monkeypatch.setitem(sim.repro.PAPERS, "fake", FAKE)
    monkeypatch.setattr(core, "POOL_DEADLINE_S", 0.5)
    monkeypatch.setattr(core.SimSpec, "run", lambda self: time.sleep(60))   # the forked workers inherit it
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within"):
        evaluate("fake", [0], jobs=2)
    assert time.monotonic() - t0 < 20                    # the workers were killed, not waited for


def test_the_pools_workers_train_at_the_sensitivity_speed_the_rows_see(monkeypatch):
    """--train-speed: the workers fork before the profiles change and apply the speed themselves, once."""
    monkeypatch.setitem(sim.repro.PAPERS, "fake", Paper(FAKE.rows[:3]))
    base, fast = evaluate("fake", [0], jobs=2), evaluate("fake", [0], jobs=2, sens=core.Sensitivity(2.0))
    assert fast == evaluate("fake", [0], jobs=1, sens=core.Sensitivity(2.0))
    assert all(f[0] < b[0] for f, b in zip(fast[0], base[0]))         # training faster: every run shorter


def _spec(preset: str, seed: int) -> core.SimSpec:
    return core.SimSpec(preset, (), TINY, seed)


def test_a_free_worker_takes_each_untimed_kind_once_then_the_longest_timed_one():
    a0, a1, b0, b1, c0 = _spec("sync", 0), _spec("sync", 1), _spec("one_step", 0), _spec("one_step", 1), \
        _spec("areal", 0)
    todo = [a0, a1, b0, b1, c0]
    assert core._next_spec(todo, [], {}) == a0
    assert core._next_spec(todo, [a0], {}) == b0                 # a's time is being learned: not a second one
    assert core._next_spec(todo, [a0, b0], {}) == c0
    assert core._next_spec([a1, b1], [c0], {a0.kind: 5.0, b0.kind: 9.0}) == b1       # longest first
    assert core._next_spec([a1, b1], [b0], {a0.kind: 5.0}) == a1
    assert core._next_spec([b1], [b0], {}) == b1                 # nothing else to do


def _tuned_once(runs: Runs) -> float:
    """A setting chosen on the first seed's run (StaleFlow's tuned split), then this seed's run at it."""
    s = runs.first.memo("pick", lambda: WIDE if _makespan(runs.first.get("one_step", TINY)) > 0 else TINY)
    return _makespan(runs.get("sync", s))


def test_a_choice_made_on_the_first_seed_holds_for_every_seed_in_the_pool_as_in_one_process(monkeypatch):
    monkeypatch.setitem(sim.repro.PAPERS, "fake", Paper([Row("t", (1, 1), "1", _tuned_once)]))
    asked = []
    ask = core._ask

    def record(all_runs, task):
        out = ask(all_runs, task)
        asked.extend((s.preset, s.setting.num_engines, s.seed) for s in out)
        return out
    monkeypatch.setattr(core, "_ask", record)
    pooled = evaluate("fake", [0, 1, 2], jobs=2)
    assert {x for x in asked if x[0] == "one_step"} == {("one_step", 2, 0)}    # chosen on the first seed only
    assert {("sync", 3, s) for s in (0, 1, 2)} <= set(asked)
    monkeypatch.setattr(core, "_ask", ask)
    alone = evaluate("fake", [0, 1, 2], jobs=1)
    assert pooled == alone and all(isinstance(v, float) for v in pooled[0][0])
    assert len(set(pooled[0][0])) > 1                     # each seed its own run, at the one chosen setting


def test_the_workers_collect_garbage_at_the_simulators_threshold_not_at_the_parents_none(monkeypatch):
    """The parent collects nothing while it gathers results; its workers must not inherit that (each result they
    send leaves reference cycles behind): they collect at the simulator's thresholds, the pool's pickling of each
    result included."""
    import gc

    from sim.run import SIM_GC_THRESHOLD
    monkeypatch.setitem(sim.repro.PAPERS, "fake", Paper([Row("g", (1, 1), "1", lambda runs: runs.get("sync", TINY))]))
    monkeypatch.setattr(core.SimSpec, "run", lambda self: float(gc.get_threshold()[0]))   # inherited by the fork
    caller = gc.get_threshold()
    assert caller[0] > 0 and caller != SIM_GC_THRESHOLD
    assert evaluate("fake", [0, 1], jobs=2)[0] == [[float(SIM_GC_THRESHOLD[0])] * 2]
    assert gc.get_threshold() == caller                     # and the parent's own is restored


def test_each_row_and_note_is_computed_once_on_each_seed_in_the_pool(monkeypatch):
    calls = []

    def row(runs: Runs) -> float:
        v = _chosen(runs)                   # raises Missing until both its runs are back
        calls.append(runs.seed)
        return v

    def note(runs: Runs) -> str:
        text = f"{_makespan(runs.get('sync', TINY)):.3f}"
        calls.append("note")
        return text
    monkeypatch.setitem(sim.repro.PAPERS, "fake", Paper([Row("b", (1, 1), "1", row)], notes=[note]))
    per_row, notes = evaluate("fake", [0, 1], jobs=2)
    assert sorted(calls, key=str) == [0, 1, "note"] and all(isinstance(v, float) for v in per_row[0])


def _policy_name(runs: Runs) -> float:
    r = runs.get("sync", TINY)
    return float(len(r.policy.dispatch.name))


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_result_keeps_its_policy_only_for_a_paper_that_reads_it_in_the_pool_as_in_one_process(monkeypatch, jobs):
    rows = [Row("p", (1, 1), "1", _policy_name)]
    monkeypatch.setitem(sim.repro.PAPERS, "fake", Paper(rows, reads_policy=True))
    assert evaluate("fake", [0], jobs=jobs)[0] == [[float(len("sync"))]]
    monkeypatch.setitem(sim.repro.PAPERS, "fake", Paper(rows))
    (value,), = evaluate("fake", [0], jobs=jobs)[0]
    assert value.startswith("failed: AttributeError") and "'NoneType'" in value

"""Metrics and the timeline from hand-built event logs with known answers."""
import pytest

from sched.events import Event, EventLog
from sched.metrics import summarize
from sched.timeline import main as timeline_main


def sync_log():
    """Two synchronous rounds on 2 engines: round r decodes 10 s (engine 1 only 5 s), trains 4 s, syncs 1 s."""
    ev, t = [], 0.0
    for r in range(2):
        ev.append(Event("round_started", t, data={"round": r, "prompts": 1}))
        ev += [Event("engine_busy", t, engine=0), Event("engine_busy", t, engine=1),
               Event("engine_idle", t + 5, engine=1), Event("engine_idle", t + 10, engine=0)]
        ev += [Event("trajectory_finished", t + 10, engine=0, req_id=r, group_id=r, data={"tokens": 100}),
               Event("group_materialized", t + 10, group_id=r, version=r, data={"round": r}),
               Event("train_started", t + 10, version=r, data={"groups": [r]}),
               Event("train_step_done", t + 14, version=r + 1),
               Event("version_published", t + 15, version=r + 1)]
        t += 15
    return ev


def test_sync_figures_are_exact():
    m = summarize(sync_log(), num_engines=2)
    assert m["makespan_s"] == pytest.approx(30)
    assert m["train_compute_s"] == pytest.approx(8)
    # trainer waits 10 s per round before its 4 s of compute; the last publish is after train end
    assert m["trainer_wait_ratio"] == pytest.approx(21 / 29)
    assert m["trainer_wait_ratio_eq4"] == pytest.approx(10 / 14)
    assert m["rollout_to_train_end_s"] == pytest.approx(14)
    assert m["engine_idle_ratio"] == pytest.approx(1 - 30 / 60)
    assert m["weight_sync_s"] == pytest.approx(1)
    assert m["staleness"] == {0: 2} and m["staleness_max"] == 0
    assert m["tokens_per_s"] == pytest.approx(200 / 30)


def test_staleness_counts_versions_behind():
    ev = sync_log()
    # the second round's group was generated under version 0 but consumed at trainer version 1
    for e in ev:
        if e.kind == "group_materialized" and e.group_id == 1:
            e.version = 0
    assert summarize(ev)["staleness"] == {0: 1, 1: 1}


def test_timeline_png(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    for e in sync_log():
        log.write(e)
    log.close()
    assert timeline_main([str(tmp_path)]) == 0
    png = tmp_path / "timeline.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert timeline_main([str(tmp_path / "missing")]) == 2


def test_staleness_at_finish_is_laminar_inherent_staleness():
    """Laminar §6: M - K with M the trainer version when the sample *finished*, not when it was trained."""
    ev = [Event("round_started", 0.0, data={"round": 0, "prompts": 3}),
          Event("trajectory_finished", 1.0, req_id=0, group_id=0, version=0, data={"tokens": 5}),
          Event("train_step_done", 2.0, version=1),
          Event("train_step_done", 3.0, version=2),
          Event("train_step_done", 3.5, version=3, data={"stepped": False}),   # accumulation only: no new version
          Event("trajectory_finished", 4.0, req_id=1, group_id=1, version=0, data={"tokens": 5}),
          Event("trajectory_finished", 4.0, req_id=2, group_id=1, version=1, data={"tokens": 5}),
          Event("group_materialized", 4.0, group_id=0, version=0),
          Event("group_materialized", 4.0, group_id=1, version=0),
          Event("train_started", 9.0, version=5, data={"groups": [0, 1]})]
    m = summarize(ev)
    assert m["staleness_at_finish"] == {0: 1, 1: 1, 2: 1} and m["staleness_at_finish_max"] == 2
    assert m["staleness"] == {5: 2}       # consume-time staleness counts the buffer wait too

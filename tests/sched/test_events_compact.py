"""The compact event log: the same events in the same order, the same figures from its consumers, a fraction of
the bytes."""
import json
import os

from sched.events import REQUEST_KINDS, Event, EventLog, decode_requests, encode_requests, read_events
from sched.metrics import summarize
from tests.support.event_logs import long_log


def test_compact_lines_decode_to_the_same_events_in_the_same_order():
    ev = [e for e in long_log(3) if e.kind in REQUEST_KINDS]
    ev.append(Event("trajectory_finished", 9.0, engine=1, req_id=99, group_id=9, version=2,
                    data={"tokens": 3, "finish_reason": "stop", "extra": [1, 2]}))   # another key set: its own table
    back = decode_requests(encode_requests(ev))
    assert back == [Event.from_json(e.to_json()) for e in ev]        # what a one-per-line log reads back (t to 1 us)
    assert [e.t for e in back] == [round(e.t, 6) for e in ev] and [e.kind for e in back] == [e.kind for e in ev]


def test_a_compact_log_reads_back_the_same_and_is_a_fraction_of_the_size(tmp_path):
    ev = long_log(150)
    full, compact = EventLog(tmp_path / "full.jsonl"), EventLog(tmp_path / "compact.jsonl", compact=True)
    for e in ev:
        full.write(e)
        compact.write(e)
        if e.kind == "train_step_done":
            compact.flush()                       # a checkpoint's mark: a line boundary after every event so far
            text = (tmp_path / "compact.jsonl").read_text()
            assert text.endswith("\n") and sum(1 for _ in read_events(tmp_path / "compact.jsonl")) == \
                ev.index(e) + 1
    full.close()
    compact.close()
    a, b = list(read_events(tmp_path / "full.jsonl")), list(read_events(tmp_path / "compact.jsonl"))
    assert a == b and len(b) == len(ev)
    assert summarize(a, 2) == summarize(b, 2)
    skip = ("request_admitted",)
    assert list(read_events(tmp_path / "compact.jsonl", skip=skip)) == [e for e in a if e.kind not in skip]
    assert os.path.getsize(tmp_path / "compact.jsonl") < 0.8 * os.path.getsize(tmp_path / "full.jsonl")
    # a long run of per-request events (a real step's: hundreds between two other events) is a quarter or less
    reqs = [e for e in ev if e.kind in REQUEST_KINDS]
    assert len(encode_requests(reqs)) < 0.3 * sum(len(e.to_json()) + 1 for e in reqs)
    # every line is still a JSON object with a string kind (what a line-by-line reader filters on)
    assert all(isinstance(json.loads(line)["kind"], str) for line in open(tmp_path / "compact.jsonl"))


def test_a_simulated_runs_consumers_give_the_same_figures_from_a_compact_log(tmp_path):
    """The simulator's tiny sync run (the runtime's event kinds): summarize and calibrate's per-event fits agree."""
    from sim.calibrate import decode_fit
    from sim.run import simulate
    r = simulate("sync", "cpu_tiny", "cpu_tiny", 1, 3, steps=4, group_size=4, prompts_per_step=8)
    paths = {}
    for name, compact in (("full", False), ("compact", True)):
        log = EventLog(tmp_path / f"{name}.jsonl", keep=False, compact=compact)
        for e in r.events:
            log.write(e)
        log.close()
        paths[name] = tmp_path / f"{name}.jsonl"
    a, b = (list(read_events(p)) for p in paths.values())
    assert any(e.kind in REQUEST_KINDS for e in a) and a == b
    assert summarize(a, 1) == summarize(b, 1) and decode_fit(a) == decode_fit(b)

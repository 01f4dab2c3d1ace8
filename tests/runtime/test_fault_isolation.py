"""Laminar's fault isolation (§3.3) in the controller: the partial-response pool streamed by the engines, a failed
engine's trajectories taken back and resumed from it on an engine of their own version, the engine left alone until
it rejoins, retired engines, and the named errors where nothing isolates faults."""
from __future__ import annotations

import pytest

import sched
from rl.types import Trajectory
from sched.base import InvariantError
from sched.controller import Controller, PromptItem
from sched.decisions import Abort, Interrupt, LoadWeights, Migrate, ResetEngine, Submit
from sched.events import Event
from sched.partials import PartialPool
from sched.resources import EngineView
from sim.tokens import RunList


class Script:
    """A backend driven by hand: events are applied by the test, decisions recorded."""

    def __init__(self, engines: int = 2, isolates: bool = True):
        self.num_engines = engines
        self.isolates_faults = isolates
        self.submits: list[tuple[int, list[int], list]] = []
        self.commands: list = []

    def now(self) -> float:
        return 0.0

    def submit(self, engine, reqs, prompts):
        self.submits.append((engine, [r.req_id for r in reqs], [r.partial for r in reqs]))

    def command(self, cmd):
        self.commands.append(cmd)

    def train(self, call, groups):
        pass

    def next_event(self):
        raise AssertionError("driven by hand")


def source(n: int) -> list[PromptItem]:
    return [PromptItem(i, [1, 2, 3], "a") for i in range(n)]


def started(engines: int = 2, isolates: bool = True, overrides=None) -> tuple[Controller, Script]:
    """A laminar controller whose engines hold v0 and took their first batches (2 groups of 2 each)."""
    ctl = Controller(sched.load_preset("laminar", overrides), source, group_size=2, prompts_per_step=2 * engines,
                     total_steps=5)
    b = Script(engines, isolates)
    ctl.v.engines = [EngineView(engine=i) for i in range(engines)]
    if isolates:
        ctl.life.fold.partials = PartialPool()   # what Controller.run does for a backend that isolates faults
    step(ctl, b, Event("version_published", 0, version=0))
    assert [c for c in b.commands if isinstance(c, LoadWeights)] == [LoadWeights(i, 0) for i in range(engines)]
    step(ctl, b, *[Event("weights_loaded", 0, engine=i, version=0) for i in range(engines)])
    assert sorted(e for e, _, _ in b.submits) == list(range(engines))
    return ctl, b


def step(ctl: Controller, b: Script, *events: Event) -> None:
    for ev in events:
        ctl.apply(ev)
    ctl.decide(b)


def on(ctl: Controller, engine: int) -> list[int]:
    return sorted(r.req_id for r in ctl.v.requests.values() if r.engine == engine and r.state == "running")


def stream(rids: list[int], n: int, version: int = 0, start: int = 0) -> dict:
    return {"partials": {rid: (start, [100 + rid] * n, [-0.5] * n, [version] * n) for rid in rids}}


def test_a_failed_engine_s_trajectories_resume_from_the_pool_on_an_engine_of_their_version():
    ctl, b = started()
    lost = on(ctl, 0)
    assert len(lost) == 4
    # the engine streams 3 tokens of each, then 2 more of the first (a chunk may overlap what the pool holds)
    step(ctl, b, Event("tokens_decoded", 0.1, engine=0, version=0, payload=stream(lost, 3)),
         Event("tokens_decoded", 0.2, engine=0, version=0,
               payload={"partials": {lost[0]: (2, [7, 8, 9], [-1.0] * 3, [0] * 3)}}))
    assert ctl.life.fold.partials.entries[lost[0]].ids == [100 + lost[0]] * 2 + [7, 8, 9]
    # a stream from another engine than the request's is ignored
    step(ctl, b, Event("tokens_decoded", 0.25, engine=1, version=0, payload=stream(lost[:1], 9)))
    assert len(ctl.life.fold.partials.entries[lost[0]].ids) == 5
    b.submits.clear()
    held = {str(lost[0]): 6, **{str(r): 4 for r in lost[1:]}}
    step(ctl, b, Event("engine_failed", 0.3, engine=0, version=0, data={"error": "OutOfMemoryError", "held": held}))
    e0 = ctl.v.engines[0]
    assert e0.failed and not e0.retired and e0.assigned == 0 and e0.failures == 1
    assert ResetEngine(0) in b.commands
    rec = [e for e in ctl.log.events if e.kind == "trajectories_recovered"][-1]
    assert rec.data == {"resumed": 4, "tokens_kept": 5 + 3 * 3, "tokens_lost": 1 + 3 * 1, "dropped": 0}
    # all four resumed at once on engine 1 (version 0), each from its tokens so far
    (eng, ids, parts), = b.submits
    assert eng == 1 and sorted(ids) == lost
    by_id = dict(zip(ids, parts))
    assert by_id[lost[0]].response_ids == [100 + lost[0]] * 2 + [7, 8, 9]
    assert by_id[lost[0]].logprobs == [-0.5, -0.5, -1.0, -1.0, -1.0] and by_id[lost[0]].versions == [0] * 5
    assert all(by_id[r].response_ids == [100 + r] * 3 for r in lost[1:])
    assert not ctl.life.fold.partials.entries.keys() - set(on(ctl, 1)), "the pool holds a request not on an engine"
    # while failed: no weights loaded into it, nothing submitted, no repack onto it
    b.commands.clear()
    b.submits.clear()
    step(ctl, b, Event("version_published", 0.4, version=1))
    assert not [c for c in b.commands if getattr(c, "engine", None) == 0] and not b.submits
    with pytest.raises(InvariantError, match="failed"):
        ctl.life.admit(Submit(0, [lost[0]]))
    # it rejoins: it pulls the newest version and takes a new batch
    step(ctl, b, Event("engine_recovered", 0.5, engine=0, version=0, data={"down_s": 0.2}))
    assert not ctl.v.engines[0].failed and LoadWeights(0, 1) in b.commands
    step(ctl, b, Event("weights_loaded", 0.6, engine=0, version=1))
    assert on(ctl, 0), "the rejoined engine took no batch"


def engine_1_moves_on() -> tuple[Controller, Script, list[int]]:
    """Engine 1 finishes its batch and loads v1; engine 0 still holds its v0 trajectories (returned)."""
    ctl, b = started()
    for rid in on(ctl, 1):
        r = ctl.v.requests[rid]
        step(ctl, b, Event("trajectory_finished", 0.1, engine=1, req_id=rid, group_id=r.group_id, version=0,
                           data={"tokens": 3}))
    step(ctl, b, Event("version_published", 0.2, version=1), Event("weights_loaded", 0.3, engine=1, version=1))
    return ctl, b, on(ctl, 0)


def test_a_resumed_trajectory_waits_for_a_failed_engine_of_its_version_or_goes_on_when_it_is_retired():
    ctl, b, lost = engine_1_moves_on()   # then engine 0 fails holding v0 trajectories
    step(ctl, b, Event("tokens_decoded", 0.35, engine=0, version=0, payload=stream(lost, 2)))
    b.submits.clear()
    step(ctl, b, Event("engine_failed", 0.4, engine=0, version=0, data={"error": "boom", "held": {}}))
    assert not [s for s in b.submits if set(s[1]) & set(lost)], "resumed on another version while v0 may rejoin"
    assert all(ctl.v.requests[r].state == "pending" for r in lost)
    step(ctl, b, Event("engine_recovered", 0.5, engine=0, version=0))
    (eng, ids, _), = [s for s in b.submits if set(s[1]) & set(lost)]
    assert eng == 0 and sorted(ids) == lost

    # the same, but the engine is retired: they resume on the newer engine (two-version trajectories)
    ctl, b, lost = engine_1_moves_on()
    b.submits.clear()
    step(ctl, b, Event("engine_failed", 0.4, engine=0, version=0, data={"error": "boom", "permanent": True}))
    assert ctl.v.engines[0].retired
    assert sorted(i for e, ids, _ in b.submits if e == 1 for i in ids) == lost
    with pytest.raises(InvariantError, match="retired"):
        ctl.apply(Event("engine_recovered", 0.5, engine=0, version=0))


def test_aborting_requests_of_a_failed_engine_close_and_every_engine_retired_ends_the_run():
    ctl, b = started()
    rid = on(ctl, 0)[0]
    ctl.command(b, Abort(0, [rid]))
    step(ctl, b, Event("engine_failed", 0.1, engine=0, version=0, data={"error": "boom"}))
    assert ctl.v.requests[rid].state == "aborted"
    assert [e for e in ctl.log.events if e.kind == "trajectory_aborted" and e.req_id == rid]
    step(ctl, b, Event("engine_failed", 0.2, engine=1, version=0, data={"error": "x", "permanent": True}))
    with pytest.raises(RuntimeError, match="every engine failed for good"):
        ctl.apply(Event("engine_failed", 0.3, engine=0, version=0, data={"error": "y", "permanent": True}))


def test_an_engine_failure_ends_a_run_that_does_not_isolate_faults():
    ctl, b = started(isolates=False)
    with pytest.raises(RuntimeError, match="engine 0 .* failed: boom; this run does not isolate"):
        ctl.apply(Event("engine_failed", 0.1, engine=0, rank=2, version=0, data={"error": "boom"}))


def test_a_preset_isolating_faults_needs_every_mechanism_to_skip_failed_engines():
    assert sched.load_preset("laminar").failures_isolated() == 3
    assert sched.load_preset("laminar", {"rebalance": {"engine_failures": 0}}).failures_isolated() == 0
    assert sched.load_preset("sync").failures_isolated() == 0
    with pytest.raises(ValueError, match="dispatch 'fifo'.*skips_failed_engines"):
        sched.load_preset("laminar", {"dispatch": {"name": "fifo"}})
    # without isolation the repack composes with any dispatch, as before
    sched.load_preset("laminar", {"dispatch": {"name": "fifo"}, "rebalance": {"engine_failures": 0}})


def test_the_pool_refuses_a_gap_and_keeps_the_resume_s_tokens():
    pool = PartialPool()
    part = Trajectory(1, 0, [1], [5, 6], [-1.0, -2.0], versions=[0, 0])
    pool.open(3, part)
    pool.grow(3, (2, [7], [-3.0], [1]))
    assert pool.entries[3].ids == [5, 6, 7] and pool.entries[3].streamed == 1 and pool.tokens_streamed == 1
    with pytest.raises(InvariantError, match="starts at token 5 but the pool holds 3"):
        pool.grow(3, (5, [8], [-1.0], [1]))
    with pytest.raises(InvariantError, match="1 ids, 2 log-probs"):
        pool.grow(3, (3, [8], [-1.0, -1.0], [1]))
    pool.grow(9, (0, [1], [0.0], [0]))   # not open (left its engine): ignored
    t = pool.take(3, None, 1, 0, [1], 4)
    assert t.response_ids == [5, 6, 7] and t.versions == [0, 0, 1] and t.prompt_index == 4 and not pool
    assert pool.take(3, part, 1, 0, [1], 4) is part   # nothing pooled: what it resumed from


def test_the_pool_keeps_the_simulator_s_run_length_chunks_as_they_are():
    """The simulator streams a request's whole trajectory so far, run-length, at every stream: the pool holds it as
    is (no per-token list), ignores a shorter one, refuses one that does not start at 0, and a list chunk after it
    still splices."""
    pool = PartialPool()
    part = Trajectory(1, 0, [1], RunList.of(7, 4), RunList.of(-1.0, 4), versions=RunList([(0, 4)]))
    pool.open(3, part)
    assert pool.entries[3].ids is part.response_ids          # kept, not copied into a list
    chunk = (0, RunList.of(7, 10), RunList.of(-1.0, 10), RunList([(0, 4), (1, 6)]))
    pool.grow(3, chunk)
    e = pool.entries[3]
    assert isinstance(e.ids, RunList) and len(e.ids) == 10 and e.versions.runs == ((0, 4), (1, 6))
    assert e.streamed == 6 and pool.tokens_streamed == 6
    pool.grow(3, (0, RunList.of(7, 8), RunList.of(-1.0, 8), RunList.of(0, 8)))   # older than what it holds
    assert len(pool.entries[3].ids) == 10 and pool.entries[3].versions.runs == ((0, 4), (1, 6))
    with pytest.raises(InvariantError, match="run-length partial chunk for request 3 starts at token 2, not 0"):
        pool.grow(3, (2, RunList.of(7, 9), RunList.of(-1.0, 9), RunList.of(1, 9)))
    pool.grow(3, (10, [5], [-0.5], [2]))
    t = pool.take(3, None, 1, 0, [1], 4)
    assert list(t.response_ids) == [7] * 10 + [5] and list(t.versions) == [0] * 4 + [1] * 6 + [2]


def test_a_migration_whose_destination_failed_meanwhile_is_resumed_elsewhere():
    """Repack interrupted a trajectory on engine 0 to move it to engine 1; engine 1 fails before the interrupt
    lands: the trajectory is not submitted to the dead engine but resumed like a failed engine's."""
    ctl, b = started(engines=3)
    rid = on(ctl, 0)[0]
    interrupts = ctl.life.migrate(Migrate(0, 1, [rid]))
    assert interrupts == [Interrupt(0, [rid], 1)] and ctl.v.migrating_to(1)
    step(ctl, b, Event("engine_failed", 0.2, engine=1, version=0, data={"error": "boom", "held": {}}))
    b.submits.clear()
    r = ctl.v.requests[rid]
    partial = Trajectory(r.group_id, r.sample_index, [1, 2, 3], [9, 9], [-1.0, -1.0], versions=[0, 0])
    step(ctl, b, Event("trajectory_interrupted", 0.3, engine=0, req_id=rid, group_id=r.group_id, version=0,
                       data={"tokens": 2}, payload=partial))
    assert not ctl.v.migrating_to(1)
    (eng, ids, parts), = b.submits
    assert eng in (0, 2) and ids == [rid] and parts[0].response_ids == [9, 9]
    assert not any(e.kind == "trajectory_migrated" for e in ctl.log.events)


def test_a_migration_whose_source_moved_to_newer_weights_is_not_resubmitted_to_an_older_destination():
    """Colocated, an engine may load newer weights while a repack interrupt is on its way to it (seen on real ranks:
    "request 384 resumed on engine 1 at version 4, older than its tokens so far (version 5)"): the trajectory,
    now holding tokens of the newer version, is not resubmitted to the older destination; dispatch resumes it on an
    engine of its newest version once there is one."""
    ctl, b = started(engines=3)
    rid = on(ctl, 0)[0]
    ctl.life.migrate(Migrate(0, 1, [rid]))
    b.submits.clear()
    r = ctl.v.requests[rid]
    partial = Trajectory(r.group_id, r.sample_index, [1, 2, 3], [9, 9, 9], [-1.0] * 3, versions=[0, 1, 1])
    step(ctl, b, Event("trajectory_interrupted", 0.3, engine=0, req_id=rid, group_id=r.group_id, version=1,
                       data={"tokens": 3}, payload=partial))
    assert not [s for s in b.submits if rid in s[1]], "resubmitted to an engine older than its tokens"
    assert ctl.v.requests[rid].state == "pending" and not ctl.v.migrating_to(1)
    for rid2 in on(ctl, 2):   # engine 2 finishes its batch and moves to version 1: the trajectory resumes there
        g = ctl.v.requests[rid2].group_id
        step(ctl, b, Event("trajectory_finished", 0.4, engine=2, req_id=rid2, group_id=g, version=0,
                           data={"tokens": 3}))
    step(ctl, b, Event("version_published", 0.5, version=1), Event("weights_loaded", 0.6, engine=2, version=1))
    assert any(eng == 2 and rid in ids for eng, ids, _ in b.submits)


def test_the_summary_counts_engine_failures_and_the_policies_own_counters():
    from sched.metrics import summarize
    ctl, b = started()
    lost = on(ctl, 0)
    step(ctl, b, Event("tokens_decoded", 0.1, engine=0, version=0, payload=stream(lost, 3)))
    step(ctl, b, Event("engine_failed", 0.2, engine=0, version=0, data={"error": "boom",
                                                                     "held": {str(r): 5 for r in lost}}))
    step(ctl, b, Event("engine_recovered", 0.7, engine=0, version=0, data={"down_s": 0.5}))
    ctl.preset.rebalance.moves = 2
    ctl.log_stats()
    s = summarize(ctl.log.events, 2)
    assert (s["engine_failures"], s["engines_retired"], s["failed_engine_resumed"]) == (1, 0, len(lost))
    assert (s["failed_engine_tokens_kept"], s["failed_engine_tokens_lost"], s["engine_down_s"]) == \
        (3 * len(lost), 2 * len(lost), 0.5)
    assert s["policy_stats"] == {"rebalance": {"moves": 2}}


def test_staleflow_counts_the_snapshots_eq1_accepted_and_those_it_estimated():
    from sim.run import simulate
    r = simulate("staleflow", "cpu_tiny", "cpu_tiny", 2, 2, steps=3, group_size=4, prompts_per_step=4,
                 progress=True, counters_every_s=0.05)
    st = r.metrics["policy_stats"]["dispatch"]
    assert st["snapshots_accepted"] + st["snapshots_estimated"] > 0 and st["snapshots_empty_pull"] > 0
    assert st["snapshots_accepted_frac"] == st["snapshots_accepted"] / (st["snapshots_accepted"]
                                                                        + st["snapshots_estimated"])
    assert "policy_stats" not in simulate("sync", "cpu_tiny", "cpu_tiny", 2, 2, steps=2, group_size=4,
                                          prompts_per_step=4).metrics

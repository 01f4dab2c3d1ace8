"""Multi-turn, tool-using episodes in the simulator (sim/episodes.py, sim/engine.py, sim/backend.py): a request on a
tool frees its decode slot and keeps its KV; the observation is prefilled, the history never again; weight loads,
interrupts, aborts and a short KV pool do what sim/engine.py says; every preset runs agentic episodes."""
import json
import math

import pytest

import sched
from sched.controller import PromptItem
from sched.decisions import Abort, Interrupt, LoadWeights
from sched.views import ON_ENGINE, Request, RequestState
from sim import compare, simulate
from sim import run as sim_run
from sim.backend import SimBackend
from sim.check import on_policy_report
from sim.episodes import (AGENTIC_LATENCY, CallSpec, Episode, LogNormalLatency, MixtureLatency, load_latency_trace)
from sim.tokens import FAKE_LOGPROB, RunList
from sim.workload import PromptSpec, TraceError, Workload, get_workload
from tests.sim.test_sim_engine import cost, drain

PROMPT = 16


class Scripted(Workload):
    """Episodes given by hand: (prompt, sample) -> Episode."""
    name, tool, multi_turn = "scripted", "calc", True

    def __init__(self, episodes: dict[tuple[int, int], Episode], max_len: int = 4096):
        self.episodes, self.max_len = episodes, max_len

    def prompt(self, index: int) -> PromptSpec:
        return PromptSpec(PROMPT, 0.0, 0.5)

    def episode(self, p: int, k: int) -> Episode:
        return self.episodes[(p, k)]

    def response_len(self, p: int, k: int) -> int:
        return self.episodes[(p, k)].length


ONE_CALL = Episode((CallSpec(10, 5, 2.0),), 20)     # 10 model tokens, a 2 s call, 5 observation tokens, 5 more


def backend(episodes, **kw) -> SimBackend:
    counters = kw.pop("counters_every_s", None)
    w = Scripted(episodes, max(e.length for e in episodes.values()))
    b = SimBackend(cost(**kw), w, 1, 1, seed=0, counters_every_s=counters)
    b.engines[0].version = 0
    return b


def submit(b: SimBackend, keys, partial=None, first: int = 0) -> None:
    reqs = [Request(first + i, p, k, p, 0, PROMPT, partial=partial) for i, (p, k) in enumerate(keys)]
    b.submit(0, reqs, {p: PromptItem(p, RunList.of(1, PROMPT), None) for p, _ in keys})




def until(b: SimBackend, kind: str) -> list:
    out = []
    while not out or out[-1].kind != kind:
        out.append(b.next_event())
    return out


def of(events, kind):
    return [e for e in events if e.kind == kind]


def prefilled(b: SimBackend) -> float:
    return b.engines[0].prefill_s_total / b.cost.prefill_s_per_token


# ------------------------------------------------------------------------------------------------- the engine
def test_a_tool_call_frees_the_decode_slot_keeps_the_kv_and_only_the_observation_is_prefilled():
    b = backend({(0, 0): ONE_CALL}, counters_every_s=0.5)
    submit(b, [(0, 0)])
    ev = drain(b)
    (start,), (end,) = of(ev, "tool_started"), of(ev, "tool_finished")
    assert start.data == {"turn": 1, "tool": "calc"} and start.req_id == 0
    assert end.data == {"turn": 1, "seconds": 2.0, "failed": False} and end.t - start.t == pytest.approx(2.0)
    # the engine stops decoding while its only request waits on the tool, and reports it on the tool, KV held
    idle = [e for e in ev if e.kind == "engine_idle" and start.t <= e.t < end.t]
    assert idle, [(e.kind, e.t) for e in ev]
    during = [e.data for e in ev if e.kind == "tokens_decoded" and start.t < e.t < end.t]
    assert all(d["running"] == 0 and d["tools"] == 1 and d["kv_used"] == 2 for d in during)   # 1 prompt + 1 own
    assert prefilled(b) == pytest.approx(PROMPT + 5)      # the prompt once, then the observation: no re-prefill
    (fin,) = of(ev, "trajectory_finished")
    assert fin.data["tokens"] == 20 and fin.t > end.t
    traj = of(ev, "reward_scored")[0].payload
    assert list(traj.loss_mask) == [1] * 10 + [0] * 5 + [1] * 5
    assert list(traj.logprobs) == [FAKE_LOGPROB] * 10 + [0.0] * 5 + [FAKE_LOGPROB] * 5
    assert b.engines[0].need(0) == 0 and not b.engines[0].tools


def test_a_request_on_a_tool_is_not_in_the_decode_batch():
    """Two requests; while one waits on its tool the other decodes alone: its steps are the batch-of-one steps."""
    long_call = Episode((CallSpec(10, 5, 100.0),), 20)
    b = backend({(0, 0): long_call, (0, 1): Episode((), 400)}, k1=0.0, k2=0.0, k3=1e-3)   # time grows with the batch
    submit(b, [(0, 0), (0, 1)])
    ev = until(b, "trajectory_finished")
    assert ev[-1].req_id == 1 and not of(ev, "tool_finished")
    c = b.cost
    expect = c.prefill_s(PROMPT) + c.steps_s(2, 0, 10) + c.steps_s(1, 0, 390)   # siblings share the prompt
    assert ev[-1].t == pytest.approx(expect, rel=1e-9)


@pytest.mark.parametrize("keep_kv", [False, True])
def test_a_weight_load_never_cancels_a_tool_call_and_a_recompute_load_re_prefills_the_history(keep_kv):
    b = backend({(0, 0): ONE_CALL})
    submit(b, [(0, 0)])
    start = until(b, "tool_started")[-1]
    b.command(LoadWeights(0, 1, keep_kv=keep_kv))          # load_s 0.25, inside the 2 s call
    ev = drain(b)
    (end,) = of(ev, "tool_finished")
    assert end.t - start.t == pytest.approx(2.0)
    traj = of(ev, "reward_scored")[0].payload
    assert list(traj.versions) == [0] * 10 + [1] * 10       # the observation is appended under the new weights
    history = PROMPT + 10
    assert prefilled(b) == pytest.approx(PROMPT + 5 + (0 if keep_kv else history))
    assert b.reprefill_s == pytest.approx(0 if keep_kv else b.cost.prefill_s(history))


def test_an_interrupt_on_a_tool_hands_back_the_turns_done_and_the_resumed_request_makes_the_call_again():
    b = backend({(0, 0): ONE_CALL})
    submit(b, [(0, 0)])
    until(b, "tool_started")
    b.command(Interrupt(0, [0]))
    ev = until(b, "trajectory_interrupted")
    part = ev[-1].payload
    assert len(part.response_ids) == 10 and list(part.loss_mask) == [1] * 10
    assert b.engines[0].need(0) == 0 and not b.engines[0].tools
    t0 = b.now()
    submit(b, [(0, 0)], partial=part)                       # its call is made again at once, from the transcript
    ev = drain(b)
    starts, ends = of(ev, "tool_started"), of(ev, "tool_finished")
    assert len(starts) == len(ends) == 1 and starts[0].t == pytest.approx(t0) and starts[0].data["turn"] == 1
    assert ends[0].t - starts[0].t == pytest.approx(2.0)    # the first call's result was dropped
    traj = of(ev, "reward_scored")[0].payload
    assert list(traj.loss_mask) == [1] * 10 + [0] * 5 + [1] * 5
    assert prefilled(b) == pytest.approx(PROMPT + PROMPT + 10 + 5)   # resumed without KV: history re-prefilled


def test_a_request_resumed_after_its_observation_continues_its_next_turn():
    episode = Episode((CallSpec(10, 5, 2.0), CallSpec(20, 3, 1.0)), 30)
    b = backend({(0, 0): episode})
    submit(b, [(0, 0)])
    until(b, "tool_finished")
    ev = until(b, "tool_started")                          # the second call: interrupted there
    assert ev[-1].data["turn"] == 2
    b.command(Interrupt(0, [0]))
    part = until(b, "trajectory_interrupted")[-1].payload
    assert list(part.loss_mask) == [1] * 10 + [0] * 5 + [1] * 5
    submit(b, [(0, 0)], partial=part)
    ev = drain(b)
    assert [e.data["turn"] for e in of(ev, "tool_started")] == [2]
    assert list(of(ev, "reward_scored")[0].payload.loss_mask) == [1] * 10 + [0] * 5 + [1] * 5 + [0] * 3 + [1] * 7


def test_an_abort_on_a_tool_frees_its_kv_and_its_result_is_dropped():
    b = backend({(0, 0): ONE_CALL})
    submit(b, [(0, 0)])
    until(b, "tool_started")
    b.command(Abort(0, [0]))
    ev = drain(b)
    (abort,) = [e for e in ev if e.req_id == 0]
    assert abort.kind == "trajectory_aborted" and abort.data["tokens"] == 10
    assert b.engines[0].need(0) == 0


def test_a_short_kv_pool_evicts_the_kv_held_by_a_request_on_a_tool_first_and_it_re_prefills_later():
    """4 blocks of 16 tokens: A on its tool holds 2, B running grows to 3 and needs the pool: A's KV goes (not B),
    and when A's call returns it re-prefills prompt + tokens + observation."""
    a = Episode((CallSpec(16, 16, 5.0),), 48)
    b_ = Episode((), 32)
    b = backend({(0, 0): a, (1, 0): b_}, kv_capacity_tokens=4 * 16)
    submit(b, [(0, 0)])
    until(b, "tool_started")
    submit(b, [(1, 0)], first=1)
    ev = drain(b)
    fin = {e.req_id: e.data for e in of(ev, "trajectory_finished")}
    assert fin[1]["preemptions"] == 0 and fin[0]["preemptions"] == 1 and fin[0]["tokens"] == 48
    assert prefilled(b) == pytest.approx(PROMPT + PROMPT + (PROMPT + 16 + 16))
    assert b.engines[0].peak_blocks <= 4


def test_nothing_running_and_held_kv_in_the_way_evicts_it_instead_of_stalling():
    """A and B both wait on tools holding KV; C cannot fit beside them; nothing runs: their KV is evicted."""
    eps = {(0, 0): Episode((CallSpec(16, 1, 50.0),), 40), (1, 0): Episode((CallSpec(16, 1, 50.0),), 40),
           (2, 0): Episode((), 40)}
    b = backend(eps, kv_capacity_tokens=4 * 16)
    submit(b, [(0, 0), (1, 0)])
    until(b, "tool_started")
    until(b, "tool_started")
    submit(b, [(2, 0)], first=2)
    ev = until(b, "trajectory_finished")
    assert ev[-1].req_id == 2 and ev[-1].t < 50
    assert b.engines[0].preemptions >= 1


# ----------------------------------------------------------------------------------------------- the workload
def test_the_agentic_workload_shares_calls_within_a_group_and_keeps_the_issue_s_ranges():
    w = get_workload("agentic_7b_8k", seed=3)
    for p in range(200):         # the prompt's: every sample of a group alike, unless the cap cut its episode
        n = w.calls_of(p)
        assert all(len(e.calls) == n or (len(e.calls) < n and e.length == w.max_len)
                   for e in (w.episode(p, k) for k in range(8)))
    counts = {len(w.episode(p, 0).calls) for p in range(200)}
    assert min(counts) >= 1 and max(counts) <= 8 and len(counts) >= 6   # truncated at the cap: fewer, never more
    secs = [c.seconds for p in range(200) for k in range(8) for c in w.episode(p, k).calls]
    assert 0.1 <= min(secs) and max(secs) <= 60
    tail = sum(s > 2 for s in secs) / len(secs)
    assert 0.05 < tail < 0.15                                   # AGENTIC_LATENCY's 10% tail
    for p in range(50):
        for k in range(4):
            ep = w.episode(p, k)
            assert ep.length == w.response_len(p, k) <= w.max_len
            assert all(c.at + c.obs <= ep.length and c.obs >= 1 for c in ep.calls)
            assert all(a.at + a.obs < b.at for a, b in zip(ep.calls, ep.calls[1:]))
    assert AGENTIC_LATENCY.mean() == pytest.approx(0.9 * 1.9 / math.log(20) + 0.1 * 58 / math.log(30))


def test_the_response_cap_cuts_an_episode_and_a_slow_call_times_out():
    w = get_workload("agentic_7b_8k").with_latency(LogNormalLatency(30.0, 1.0))
    w = type(w)(**{**w.__dict__, "max_len": 600, "timeout_s": 20.0})
    eps = [w.episode(p, k) for p in range(100) for k in range(4)]
    assert max(e.length for e in eps) == 600 and all(e.length <= 600 for e in eps)
    calls = [c for e in eps for c in e.calls]
    assert any(c.failed for c in calls) and all(c.seconds == 20.0 for c in calls if c.failed)
    assert all(c.seconds <= 20.0 and (c.failed or c.seconds < 20.0) for c in calls)


def test_a_latency_trace_in_each_format_and_its_errors(tmp_path):
    (tmp_path / "a.json").write_text("[0.5, 2.0, 30.0]")
    (tmp_path / "b.json").write_text('{"seconds": [0.5, 2.0, 30.0]}')
    (tmp_path / "c.jsonl").write_text('0.5\n{"seconds": 2.0, "tool": "search"}\n\n30\n')
    for name in ("a.json", "b.json", "c.jsonl"):
        lat = load_latency_trace(tmp_path / name)
        assert lat.values == (0.5, 2.0, 30.0)
    w = get_workload("agentic_7b_8k").with_latency(lat)
    secs = {c.seconds for p in range(40) for c in w.episode(p, 0).calls}
    assert secs == {0.5, 2.0, 30.0}
    for text, says in (("[]", "holds no calls"), ('{"s": 1}', "expected a JSON list"), ("[1, -2]", "entry 1"),
                       ("[1, true]", "entry 1")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(TraceError, match=says):
            load_latency_trace(tmp_path / "bad.json")
    (tmp_path / "bad.jsonl").write_text('1.0\n{"sec": 2}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2: field 'seconds' is missing"):
        load_latency_trace(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="tail_p"):
        MixtureLatency((0.1, 2.0), (2.0, 60.0), 1.5)


# ---------------------------------------------------------------------------------------- every preset, agentic
class Checked(sim_run.Controller):
    """The controller, with its views checked after every decision: the tables in step, and a request on a tool
    always one an engine holds."""
    def decide(self, backend) -> None:
        super().decide(backend)
        self.v.check()
        for r in self.v.requests.in_state(*ON_ENGINE):
            assert r.engine >= 0
        assert not [r for r in self.v.requests.values() if r.on_tool and r.state not in ON_ENGINE]


@pytest.mark.parametrize("name", compare.presets())
def test_every_preset_runs_agentic_episodes_with_the_invariants_checked(name, monkeypatch):
    monkeypatch.setattr(sim_run, "Controller", Checked)
    p = sched.load_preset(name)
    declared = [x for q in p.policies().values() if (x := q.staleness_bound()) is not None]
    for seed in (0, 1):
        r = simulate(name, "agentic_7b_8k", "h800_7b", 3, 3, steps=10**9, group_size=4, prompts_per_step=6,
                     seed=seed, samples=3 * 6 * 4, counters_every_s=1.0)
        rep = on_policy_report(r.events)
        done = r.metrics["samples_trained"]
        assert done >= 3 * 6 * 4 and done <= rep["trained"] and rep["trained_twice"] == []
        starts = [e for e in r.events if e.kind == "tool_started"]
        ends = [e for e in r.events if e.kind == "tool_finished"]
        assert starts and len(ends) <= len(starts)
        trained = [t for e in r.events if e.kind == "reward_scored" for t in [e.payload]]
        w = get_workload("agentic_7b_8k", seed)
        for t in trained:         # every scored episode whole: its model turns and observations, masked
            ep = w.episode(t.prompt_index, t.sample_index)
            assert len(t.response_ids) == ep.length
            assert len(t.loss_mask) - sum(t.loss_mask) == sum(c.obs for c in ep.calls)
        if p.weight_sync.name == "barrier" and not any(declared):
            assert rep["off_policy_round"] == [] and rep["finished_not_trained"] == []
        else:
            group_of = {e.req_id: e.group_id for e in r.events if e.kind == "trajectory_finished"}
            stranded = [rid for rid in rep["finished_not_trained"]
                        if group_of[rid] not in r.views.groups or r.views.groups[group_of[rid]].closed]
            assert stranded == []


def test_requests_on_tools_are_marked_in_the_controller_while_they_wait(monkeypatch):
    on_tool = []

    class Watch(Checked):
        def decide(self, backend) -> None:
            super().decide(backend)
            on_tool.append(sum(r.on_tool for r in self.v.requests.values()))

    monkeypatch.setattr(sim_run, "Controller", Watch)
    r = simulate("sync", "agentic_7b_8k", "h800_7b", 2, 2, steps=2, group_size=2, prompts_per_step=4, seed=0)
    assert max(on_tool) > 0 and on_tool[-1] == 0
    assert r.views.requests.count(RequestState.RUNNING) == 0


def test_the_agentic_compare_runs_and_names_its_workload(capsys, tmp_path):
    assert compare.main(["--json", "--gpus", "4", "--rounds", "1", "--prompts", "4", "--group-size", "2",
                         "--workload", "agentic_7b_8k", "--no-plots", "--presets", "sync,areal,partial_rollout"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["preset"] for r in rows] == ["sync", "areal", "partial_rollout"]
    assert all("error" not in r and r["throughput"] > 0 for r in rows), rows
    assert rows[0]["calls_redone"] == 0 and all(r["calls_redone"] >= 0 for r in rows)
    trace = tmp_path / "seconds.json"
    trace.write_text("[30.0]")                      # every call 30 s: sync's round waits on them
    small = ["--json", "--gpus", "4", "--rounds", "1", "--prompts", "4", "--group-size", "2", "--no-plots",
             "--presets", "sync"]
    assert compare.main([*small, "--workload", "agentic_7b_8k", "--tool-trace", str(trace)]) == 0
    slow = json.loads(capsys.readouterr().out)[0]
    assert slow["throughput"] < rows[0]["throughput"] and slow["engine_idle_ratio"] > rows[0]["engine_idle_ratio"]
    assert compare.main([*small, "--tool-trace", str(trace)]) == 2
    assert "--tool-trace needs a multi-turn workload" in capsys.readouterr().err


def test_an_engine_killed_with_requests_on_tools_loses_their_calls_and_their_episodes_resume_elsewhere():
    """Laminar's fault isolation on agentic episodes: the killed engine's requests, those on tools included, resume
    elsewhere from the partial-response pool (a call in flight on it makes no tool_finished there and is made again);
    nothing is lost or trained twice."""
    from sim.backend import EngineFault
    from sim.repro.laminar_faults import check_nothing_lost
    kill = 20.5
    r = simulate("laminar", "agentic_7b_8k", "h800_7b", 4, 4, steps=4, group_size=4, prompts_per_step=8, seed=0,
                 counters_every_s=1.0, stream_every_s=2.0, faults=(EngineFault(kill, (0,), 30.0),))
    (failed,) = [e for e in r.events if e.kind == "engine_failed"]
    last = {}                    # req -> its last tool or leaving event on engine 0 before the kill
    for e in r.events:
        if e.engine == 0 and e.t <= failed.t and e.kind in ("tool_started", "tool_finished", "trajectory_finished",
                                                            "trajectory_aborted", "trajectory_interrupted"):
            last[e.req_id] = e.kind
    on_tool = {rid for rid, kind in last.items() if kind == "tool_started"}
    assert on_tool and on_tool <= {int(k) for k in failed.data["held"]}, "nobody was on a tool at the kill"
    assert not [e for e in r.events if e.kind == "tool_finished" and e.engine == 0 and failed.t <= e.t < failed.t + 30]
    again = {e.req_id for e in r.events if e.kind == "tool_started" and e.t > failed.t}
    assert on_tool & again
    check_nothing_lost(r)


def test_staleflow_accepts_the_engines_counters_while_requests_wait_on_tools():
    """StaleFlow's Eq. 1 check (sched/policies/staleflow/state.py): an engine's reported batch + queue plus the
    controller's requests on tools is what it holds, so the snapshot reads the engine's counters (counting a request
    on a tool in the batch failed the check on most snapshots and fell back to an estimate)."""
    r = simulate("staleflow", "agentic_7b_8k", "h800_7b", 4, 4, steps=10**9, group_size=4, prompts_per_step=8, seed=0,
                 samples=3 * 8 * 4, counters_every_s=1.0)
    st = r.policy.dispatch.state
    assert st.snaps_accepted > 2 * st.snaps_estimated, (st.snaps_accepted, st.snaps_estimated)

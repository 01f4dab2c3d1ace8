"""Multi-turn episodes on a rollout worker without a cluster (runtime/episodes.py): tool calls run beside decoding
and their observations extend the request; the trajectory's loss mask covers exactly the observations; timeouts and
exceptions become failed observations; an environment that breaks ends its episode with an error, scored 0; an
interrupt while a tool runs abandons the call, and the resumed episode finishes as if it had never stopped."""
import threading
import time
from dataclasses import dataclass, field

import pytest

from rl.env import Observation, ToolCall
from rl.tasks import SyntheticTask
from runtime.episodes import count_turns, last_turn
from runtime.messages import Start
from runtime.reward_scorer import InlineScorer
from sched.decisions import Abort, Interrupt
from tests.support.worker import events_of, group_specs, loaded_worker

pytestmark = pytest.mark.usefixtures("one_thread")

OBS_TEXT, FAILED_TEXT = "cd", "ee"


@dataclass
class FakeEnv:
    """Calls a tool after every turn (up to max_turns); the tool answers OBS_TEXT after `delay_s`, or raises."""
    max_turns: int = 3
    timeout_s: float = 5.0
    delay_s: float = 0.0
    raises: str = ""          # "run": the tool raises; "act": the environment's own code raises
    calls: list = field(default_factory=list)

    def act(self, turn_text):
        if self.raises == "act":
            raise RuntimeError("a broken environment")
        return ToolCall("echo", turn_text)

    def run(self, call):
        self.calls.append(call)
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.raises == "run":
            raise RuntimeError("the tool crashed")
        return Observation(OBS_TEXT, seconds=self.delay_s)

    def observation(self, obs):
        return FAILED_TEXT if obs.failed else obs.text


TASK = SyntheticTask("reverse", 16, 0)     # the task make_worker uses
TOK = TASK.tokenizer()


def encode(text):
    return TOK.encode(text, add_special_tokens=False)


def tool_worker(env, max_new_tokens=24, texts=None):
    """A worker with `env`: turns stop at "a" or "b" (a random tiny model's turns of a few tokens)."""
    def score(text, answer):
        if texts is not None:
            texts.append(text)
        return TASK.score(text, answer)
    return loaded_worker(max_new_tokens=max_new_tokens, temperature=1.0, env=env, encode=encode,
                         turn_stops=tuple(encode("ab")), scorer=InlineScorer(score))


def drive(w, timeout_s=60.0, on_step=None):
    """Step the worker's engine and take its tool results until every episode is over (a deadline on it all)."""
    deadline = time.monotonic() + timeout_s
    while w.engine.has_unfinished() or w.episodes.pending:
        assert time.monotonic() < deadline, "episodes did not finish"
        w._tools()
        if w.engine.has_unfinished():
            if on_step is not None:
                on_step(w)
            w.step()
        else:
            time.sleep(0.001)
    w.flush()


def obs_runs(t):
    """The observation spans of a trajectory (runs of mask 0), as token lists."""
    runs, cur = [], None
    for tok, m in zip(t.response_ids, t.loss_mask):
        if m == 0:
            cur = [] if cur is None else cur
            cur.append(tok)
        elif cur is not None:
            runs.append(cur)
            cur = None
    return runs + ([cur] if cur is not None else [])


def check_episode(t, tok, stops, events):
    """A finished episode's trajectory against its events: mask, observations, turns, counters."""
    assert t.loss_mask is not None and len(t.loss_mask) == len(t.response_ids) == len(t.logprobs) == len(t.versions)
    runs = obs_runs(t)
    assert all(r in (encode(OBS_TEXT), encode(FAILED_TEXT)) for r in runs)
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if not m)
    assert all(lp < 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m)
    turns = count_turns(t.response_ids, t.loss_mask)
    assert t.meta["turns"] == turns and 1 <= turns <= 3
    assert t.meta["tool_calls"] == len(runs) + (t.finish_reason == "length" and t.loss_mask[-1] == 1
                                                and t.response_ids[-1] in stops)
    started = [e for e in events if e.kind == "tool_started" and e.req_id == t.meta["req_id"]]
    finished = [e for e in events if e.kind == "tool_finished" and e.req_id == t.meta["req_id"]]
    assert len(started) == len(finished) == t.meta["tool_calls"]
    assert [e.data["turn"] for e in started] == list(range(1, len(started) + 1))
    assert t.meta["tool_failures"] == sum(e.data["failed"] for e in finished)


def scored(ch):
    out = {}
    for e in events_of(ch, "reward_scored"):
        assert e.req_id not in out, f"request {e.req_id} scored twice"
        e.payload.meta["req_id"] = e.req_id
        out[e.req_id] = e.payload
    return out


def test_tool_calls_run_beside_decoding_and_observations_are_masked():
    env, texts = FakeEnv(delay_s=0.02), []
    w, ch, task, tok = tool_worker(env, texts=texts)
    specs = group_specs(task, tok, n_groups=2, group_size=4)
    w.handle(Start(specs))
    overlap = []
    drive(w, on_step=lambda w: overlap.append(w.episodes.pending))
    got = scored(ch)
    assert sorted(got) == sorted(s.req_id for s in specs)
    events = [e for _, batch in ch.sent for e in batch]
    assert len(events_of(ch, "trajectory_finished")) == len(specs)
    stops = set(w.turn_stops)
    for t in got.values():
        check_episode(t, tok, stops, events)
    assert max(t.meta["turns"] for t in got.values()) == 3 and sum(t.meta["tool_calls"] for t in got.values()) > 4
    assert sum(overlap) > 0   # the engine stepped while tool calls were in flight
    assert sum(t.meta["tool_seconds"] for t in got.values()) >= 0.02 * len(env.calls) * 0.9
    # the reward saw each episode's last model turn, and the environment each turn's text
    want = sorted(w.decode(last_turn(t.response_ids, t.loss_mask)) for t in got.values())
    assert sorted(texts) == want
    assert not w.episodes.calls and not w.episodes.stats and not w.answers
    w.close()


@pytest.mark.parametrize("failure", ["timeout", "exception"])
def test_a_tool_timeout_or_exception_becomes_a_failed_observation(failure):
    env = FakeEnv(timeout_s=0.05, delay_s=2.0) if failure == "timeout" else FakeEnv(raises="run")
    w, ch, task, tok = tool_worker(env)
    specs = group_specs(task, tok, n_groups=1, group_size=3)
    w.handle(Start(specs))
    t0 = time.monotonic()
    drive(w, timeout_s=30)
    got = scored(ch)
    events = [e for _, batch in ch.sent for e in batch]
    assert sorted(got) == sorted(s.req_id for s in specs)
    finished = events_of(ch, "tool_finished")
    assert finished and all(e.data["failed"] for e in finished)
    enc = encode(FAILED_TEXT)
    for t in got.values():
        check_episode(t, tok, set(w.turn_stops), events)
        assert all(r == enc for r in obs_runs(t)) and t.meta["tool_failures"] == t.meta["tool_calls"]
    if failure == "timeout":   # the waits were cut at the deadline, not at the tool's 2 s
        assert all(0.05 <= e.data["seconds"] < 1.0 for e in finished)
        assert time.monotonic() - t0 < 2.0 * len(finished)
    w.close()


def test_an_environment_that_breaks_ends_its_episode_with_an_error_scored_zero():
    w, ch, task, tok = tool_worker(FakeEnv(raises="act"))
    specs = group_specs(task, tok, n_groups=1, group_size=2)
    w.handle(Start(specs))
    drive(w)
    got = scored(ch)
    assert sorted(got) == sorted(s.req_id for s in specs)
    for t in got.values():
        if t.finish_reason == "error":
            assert t.reward == 0.0 and "broken environment" in t.meta["env_error"] and t.meta["turns"] == 1
    assert any(t.finish_reason == "error" for t in got.values())
    assert not events_of(ch, "tool_started")
    w.close()


@pytest.mark.parametrize("how", ["interrupt", "migrate"])
def test_an_interrupt_while_a_tool_runs_abandons_it_and_the_resumed_episode_is_unchanged(how):
    ref, ref_ch, task, tok = tool_worker(FakeEnv())
    specs = group_specs(task, tok, n_groups=2, group_size=3)
    ref.handle(Start(specs))
    drive(ref)
    want = scored(ref_ch)
    ref.close()

    gate = threading.Event()
    env = FakeEnv()
    env.run = lambda call, run=env.run: (gate.wait(10), run(call))[1]   # the tools hang until the gate opens
    a, a_ch, _, _ = tool_worker(env)
    a.handle(Start(specs))
    deadline = time.monotonic() + 30
    while not (a.episodes.pending and not a.engine.has_unfinished()) and time.monotonic() < deadline:
        a._tools()
        if a.engine.has_unfinished():
            a.step()
    waiting = sorted(a.episodes.calls)
    assert waiting, "no request waited on a tool"
    a.handle(Interrupt(0, waiting, dst=1 if how == "migrate" else -1))
    a.flush()
    gate.set()
    interrupted = {e.req_id: e.payload for e in events_of(a_ch, "trajectory_interrupted")}
    assert sorted(interrupted) == waiting and not a.episodes.calls
    for rid, part in interrupted.items():
        assert part.loss_mask is not None and len(part.loss_mask) == len(part.response_ids)
        assert part.response_ids[-1] in a.turn_stops or part.response_ids[-1] in a.engine.eos_ids
        assert part.response_ids == want[rid].response_ids[:len(part.response_ids)]
        assert part.loss_mask == want[rid].loss_mask[:len(part.loss_mask)]
        assert part.meta["tool_calls"] == count_turns(part.response_ids, part.loss_mask) - 1   # not the abandoned
    time.sleep(0.05)
    a._tools()   # the abandoned calls' results (the gate opened) are ignored
    assert not a.engine.seqs.keys() & set(waiting)
    a.handle(Abort(0, [s.req_id for s in specs if s.req_id not in waiting]))
    a.close()

    b, b_ch, _, _ = tool_worker(FakeEnv())
    b.handle(Start([s.__class__(**{**s.__dict__, "partial": interrupted[s.req_id]})
                    for s in specs if s.req_id in interrupted]))
    drive(b)
    got = scored(b_ch)
    assert sorted(got) == waiting
    events = [e for _, batch in b_ch.sent for e in batch]
    for rid, t in got.items():
        w0 = want[rid]
        assert t.response_ids == w0.response_ids and t.loss_mask == w0.loss_mask
        assert t.meta["turns"] == w0.meta["turns"] and t.meta["tool_calls"] == w0.meta["tool_calls"]
        assert (t.reward, t.correct) == (w0.reward, w0.correct)
        # the resumed rank ran the call the first one abandoned: its turn counted from the transcript
        first = [e.data["turn"] for e in events if e.kind == "tool_started" and e.req_id == rid]
        assert first and first[0] == count_turns(interrupted[rid].response_ids, interrupted[rid].loss_mask)
    b.close()


def test_single_turn_workers_are_unchanged():
    w, ch, task, tok = loaded_worker(max_new_tokens=8)
    w.handle(Start(group_specs(task, tok, n_groups=1, group_size=2)))
    while w.engine.has_unfinished():
        w.step()
    w.flush()
    assert w.episodes is None
    assert all(e.payload.loss_mask is None and "turns" not in e.payload.meta for e in events_of(ch, "reward_scored"))


def test_the_partial_pool_keeps_a_multi_turn_request_s_mask_for_an_engine_failure():
    """Under fault isolation the counters stream each request's tokens to the controller's pool; a multi-turn
    request's chunks carry its mask, so the partial an engine failure resumes from still masks its observations."""
    from sched.partials import PartialPool
    w, ch, task, tok = tool_worker(FakeEnv())
    w.health.isolated = 1
    w._counters = lambda before: None   # the chunks come here, not in the counters' events
    specs = group_specs(task, tok, n_groups=1, group_size=3)
    w.handle(Start(specs))
    pool = PartialPool()
    for s in specs:
        pool.open(s.req_id, None)
    deadline = time.monotonic() + 30
    while not any(s.appended for s in w.engine.seqs.values()):
        assert time.monotonic() < deadline
        w._tools()
        w.step() if w.engine.has_unfinished() else time.sleep(0.001)
        for rid, chunk in w.health.partials().items():
            pool.grow(rid, chunk)
    for _ in range(3):   # a few more tokens after the observation
        w.step() if w.engine.has_unfinished() else None
    for rid, chunk in w.health.partials().items():
        pool.grow(rid, chunk)
    extended = [rid for rid, s in w.engine.seqs.items() if s.appended]
    for rid in extended:
        seq = w.engine.seqs[rid]
        part = pool.take(rid, None, 0, 0, seq.request.prompt_ids, 0)
        assert part.response_ids == seq.token_ids[seq.num_prompt_tokens:] and part.loss_mask == seq.mask()
        assert 0 in part.loss_mask
    w.close()

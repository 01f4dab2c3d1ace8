"""Multi-turn, tool-using episodes for real: torchrun with an environment (`[env]`), the controller's invariants
checked as it runs (an InvariantError ends the run) and again on the event log; tool failures become observations;
a checkpoint taken while episodes wait on tools resumes; the tiny tools run learns."""
from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.test_presets_e2e import check_log
from tests.support.launch import event_rows, metrics, torchrun
from tests.support.offpolicy_log import check_offpolicy_log

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# the tiny run's task; lookup calls that take 0.1 s each (its unknown keys: failed observations), running beside
# decoding as in a real run: not deterministic, which waits for every call at each poll (runtime/episodes.py)
LOOKUP = ["--env.kind=lookup", "--env.latency_s=0.1", "--env.tool_timeout_s=5", "--rollout.max_new_tokens=12",
          "--rollout.prompts_per_step=8", "--checkpoint.export_hf=false", "--deterministic=false"]


def check_invariants(run: Path, preset: str) -> None:
    """The log checks of tests/e2e/test_presets_e2e.py: on-policy presets train every sample at its round's version,
    off-policy ones within their rules; none trains a group twice or loses a finished sample."""
    if preset in ("sync", "rollpacker"):
        report = check_log(run)
        assert report["off_policy"] == [] and report["twice"] == [] and report["lost"] == [], report
    else:
        report = check_offpolicy_log(event_rows(run / "events.jsonl"), None)
        assert report["twice"] == report["lost"] == report["unreturned"] == report["stale"] == [], report
        assert report["unmaterialised_trained"] == [] and report["trained_groups"] > 0, report


def check_tools(run: Path, strict: bool = True) -> dict:
    """The tool events against the episodes: every call that returned was started, on the same engine, one turn
    at a time; each request's `trajectory_finished` comes once, and never while a call of it is in flight. Not
    `strict` (a resumed run's log: requests caught mid-way by the checkpoint start again): the counts only."""
    events = event_rows(run / "events.jsonl")
    in_flight: dict[int, dict] = {}
    finished: Counter[int] = Counter()
    started = returned = failed = abandoned = 0
    for e in events:
        k, rid = e["kind"], e.get("req_id")
        if k == "tool_started":
            assert rid not in in_flight or not strict, f"request {rid} started a call while one was in flight"
            in_flight[rid] = e
            started += 1
        elif k == "tool_finished":
            s = in_flight.pop(rid)
            assert s["engine"] == e["engine"] and s["data"]["turn"] == e["data"]["turn"] >= 1 or not strict
            returned += 1
            failed += e["data"]["failed"]
        elif k in ("trajectory_interrupted", "trajectory_aborted"):
            abandoned += in_flight.pop(rid, None) is not None   # the call is abandoned with the request
        elif k == "trajectory_finished":
            assert rid not in in_flight or not strict, f"request {rid} finished while its call was in flight"
            finished[rid] += 1
    assert all(n == 1 for n in finished.values()) or not strict, [r for r, n in finished.items() if n > 1]
    return {"started": started, "returned": returned, "failed": failed, "abandoned": abandoned,
            "finished": len(finished), "in_flight": len(in_flight)}


# Four presets in the suite (a synchronous, an off-policy partial, a migrating and an over-provisioning one); every
# preset with TIDAL_ALL_PRESETS=1 (bench/results/cpu-runtime.md, "Multi-turn episodes under every preset").
PRESETS = (sorted(p.stem for p in (Path(__file__).parents[2] / "configs" / "sched").glob("*.toml"))
           if os.environ.get("TIDAL_ALL_PRESETS") else ["sync", "partial_rollout", "laminar", "rollpacker"])


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_runs_multi_turn_episodes_on_real_ranks_and_keeps_the_invariants(preset, tmp_path):
    run = tmp_path / preset
    torchrun(3, f"--log.dir={run}", f"--sched.preset={preset}", "--cluster.rollout_ranks=2", "--train.steps=4",
             *LOOKUP)   # 2 engines, 1 train rank: FSDP2 across ranks is test_train_e2e's
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    check_invariants(run, preset)
    tools = check_tools(run)
    trained = sum(r["samples"] for r in metrics(run))   # a step: 8 groups of 8, or as few as a streamed group
    assert tools["started"] > 10 and trained >= 4 * 8 and tools["finished"] >= trained, (trained, tools)
    if preset == "rollpacker":   # over-provisioned rounds: the episodes still waiting on calls are the stragglers
        assert tools["abandoned"] > 0, tools
    else:   # a random model's keys are unknown: failed observations, and the episodes went on
        assert tools["returned"] > 10 and tools["failed"] > 0, tools


def test_a_checkpoint_taken_while_episodes_wait_on_tools_resumes(tmp_path):
    """partial_rollout overlaps rounds with training and interrupts at every publication, so the step-2 checkpoint
    is taken with requests mid-episode (waiting on a call, or interrupted with their partial and its loss mask);
    resumed from it, the run trains every step once and loses nothing."""
    import torch
    common = ["--sched.preset=partial_rollout", "--cluster.rollout_ranks=2", "--train.steps=4",
              "--checkpoint.every=2", "--checkpoint.keep=3", *LOOKUP]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    torchrun(4, f"--log.dir={full}", *common)
    state = torch.load(full / "checkpoints" / "step_2" / "extra_rank0.pt", weights_only=True)
    reqs = state["extra"]["extra"]["controller"]["views"]["requests"]
    mid = [r for r in reqs if r["state"] != "finished" and (r["tool_calls"] > 0 or (
        r["partial"] is not None and 0 in (r["partial"]["loss_mask"] or [])))]
    assert mid, "no episode was mid-way at the checkpoint"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    for name in ("events.jsonl", "metrics.jsonl"):
        shutil.copy(full / name, resumed / name)
    torchrun(4, f"--log.dir={resumed}", "--checkpoint.resume=latest", *common)
    assert [r["step"] for r in metrics(resumed)] == [1, 2, 3, 4]
    check_invariants(full, "partial_rollout")
    check_invariants(resumed, "partial_rollout")
    assert check_tools(resumed, strict=False)["returned"] > check_tools(full)["returned"] // 2
    # the resumed run's own events: its log is the full run's cut back to the checkpoint, then its own
    full_rows, rows = event_rows(full / "events.jsonl"), event_rows(resumed / "events.jsonl")
    kept = next((i for i, (a, b) in enumerate(zip(full_rows, rows)) if a != b), min(len(full_rows), len(rows)))
    after = rows[kept:]
    mid_ids = {r["req_id"] for r in mid}
    # every episode caught mid-way was taken up again by the resumed run (one still going when its last step ends
    # is in flight there, as in any run), and some finished
    assert mid_ids <= {e.get("req_id") for e in after}
    assert mid_ids & {e["req_id"] for e in after if e["kind"] == "trajectory_finished"}


def test_an_engine_failure_mid_episode_resumes_from_the_pool_with_its_loss_mask(tmp_path):
    """Laminar's fault isolation with episodes (rank 2's engine fails at its 20th step, unrebuildable for 1 s):
    the requests it held, waiting on calls or decoding a turn, resume on the other engine from the partial-response
    pool, whose chunks carry the loss mask, and finish; the run keeps the off-policy invariants."""
    run = tmp_path / "laminar"
    env = {"TIDAL_FAULTS": "fail 2 decode 20 1.0 & slow 0 train 3 0.8"}
    torchrun(4, f"--log.dir={run}", "--sched.preset=laminar", "--cluster.rollout_ranks=2", "--train.steps=6",
             *LOOKUP, env=env)
    assert [r["step"] for r in metrics(run)] == list(range(1, 7))
    check_invariants(run, "laminar")
    events = event_rows(run / "events.jsonl")
    failed = next(e for e in events if e["kind"] == "engine_failed")
    held = {int(r) for r in failed["data"]["held"]}
    assert held and held <= {e["req_id"] for e in events if e["kind"] == "trajectory_finished"}
    check_tools(run, strict=False)


def test_colocated_ranks_run_multi_turn_episodes(tmp_path):
    """Colocated mode (every rank an engine and a trainer shard): the same episodes, tool calls beside decoding."""
    run = tmp_path / "colocated"
    torchrun(2, f"--log.dir={run}", "--cluster.colocate=true", "--train.steps=3", *LOOKUP)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    check_invariants(run, "sync")
    tools = check_tools(run)
    assert tools["returned"] > 10 and tools["failed"] > 0, tools



def test_the_tiny_tools_run_learns_to_call_the_calculator(tmp_path):
    """configs/tiny-tools.toml as the README runs it: the reward rises well past what the worked examples alone give
    (a run without the tool ends near 0.43), and through the calculator: by the end about one successful call per
    product (half the prompts), almost none failing."""
    run = tmp_path / "tiny-tools"
    torchrun(4, "--config", "configs/tiny-tools.toml", f"--log.dir={run}", "--checkpoint.export_hf=false",
             timeout=900)
    m = metrics(run)
    k = len(m) // 5
    first, last = m[:k], m[-k:]

    def avg(f, rows):
        return sum(f(r) for r in rows) / len(rows)
    reward = [avg(lambda r: r["reward_mean"], rows) for rows in (first, last)]
    ok_calls = [avg(lambda r: r["tool_calls_mean"] * (1 - r["tool_failed_frac"]), rows) for rows in (first, last)]
    failed = [avg(lambda r: r["tool_failed_frac"], rows) for rows in (first, last)]
    assert reward[0] < 0.15 and reward[1] > 0.55, reward
    assert ok_calls[0] < 0.1 and ok_calls[1] > 0.35, ok_calls
    assert failed[1] < 0.1 and failed[1] < failed[0] / 4, failed


def tool_trace(run: Path) -> list[tuple]:
    """The tool calls and episode ends of a run's event log, in order, without their times."""
    return [(e["kind"], e.get("req_id"), (e.get("data") or {}).get("turn"))
            for e in event_rows(run / "events.jsonl")
            if e["kind"] in ("tool_started", "tool_finished", "trajectory_finished")]


def test_a_deterministic_multi_turn_run_repeats_its_batches_whatever_the_tool_threads_timing(tmp_path):
    """`deterministic = true` waits for every call in flight at each poll (runtime/episodes.py, lockstep): one tool
    thread and 20 ms calls queue behind each other, so without the wait an observation joins whichever step its
    thread finished near; with it, two runs log the same calls and episode ends in the same order, and the same
    rewards and losses."""
    runs = []
    for name in ("a", "b"):
        runs.append(tmp_path / name)
        torchrun(2, f"--log.dir={runs[-1]}", "--train.steps=3", *LOOKUP, "--deterministic=true",
                 "--env.latency_s=0.02", "--env.tool_workers=1")
    a, b = (tool_trace(r) for r in runs)
    assert sum(k == "tool_started" for k, _, _ in a) > 10 and a == b
    assert [(r["reward_mean"], r["loss"]) for r in metrics(runs[0])] == \
        [(r["reward_mean"], r["loss"]) for r in metrics(runs[1])]

"""Every scheduling preset, for real: torchrun with 2 rollout ranks and 1 train rank (Laminar's runs: 2 train ranks)
on the long-tail length workload (bench/policies.py WORKLOAD: the `repeat` task with per-prompt caps); the invariants
of docs/architecture.md are checked on the run's own event log, and the response lengths on it are long-tailed and
group-correlated. A second train rank would cost a few seconds of CPU a run (its start-up) and check nothing here: the
policies decide on the train partition's steps, not its size (FSDP2 across train ranks: tests/e2e/test_train_e2e.py)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bench.policies import WORKLOAD
from tests.support.launch import event_rows, metrics, torchrun
from tests.support.offpolicy_log import check_offpolicy_log

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def check_log(run: Path) -> dict:
    events = event_rows(run / "events.jsonl")
    version, round_version, group_round, sample_versions = 0, {}, {}, {}
    trained: Counter[int] = Counter()
    off_policy = []
    dropped = {e["req_id"] for e in events if e["kind"] == "trajectory_aborted" and not e["data"].get("requeue")}
    for e in events:
        if e["kind"] == "reward_scored" and e["req_id"] not in dropped:
            sample_versions.setdefault(e["group_id"], []).append(e["version"])
        elif e["kind"] == "group_materialized":
            group_round[e["group_id"]] = e["data"]["round"]
    for e in events:
        if e["kind"] == "train_step_done" and e["data"].get("stepped", True):
            version = e["version"]
        elif e["kind"] == "round_started":
            round_version[e["data"]["round"]] = version
        elif e["kind"] == "train_started":
            for g in e["data"]["groups"]:
                trained[g] += 1
                want = round_version[group_round[g]]
                off_policy += [(g, v, want) for v in sample_versions[g] if v != want]
    last_round = max(round_version)
    finished = {e["req_id"]: e["group_id"] for e in events if e["kind"] == "trajectory_finished"}
    lost = [r for r, g in finished.items()
            if g not in trained and r not in dropped and group_round.get(g, last_round) != last_round]
    return {"off_policy": off_policy, "twice": [g for g, n in trained.items() if n > 1], "lost": lost,
            "dropped": len(dropped), "trained_groups": len(trained)}


@pytest.mark.parametrize("preset", ["rolloutpipe", "rollpacker", "streamrl", "fgd_tailbatch"])
def test_preset_runs_on_real_ranks_and_keeps_the_invariants(preset, tmp_path):
    run = tmp_path / preset
    pin = ["--perf.cpu_affinity=partition"] if preset == "rolloutpipe" else []  # bench/policies.py's setting
    torchrun(3, f"--log.dir={run}", f"--sched.preset={preset}", "--cluster.rollout_ranks=2", "--train.steps=6",
             "--rollout.prompts_per_step=8", "--checkpoint.export_hf=false", *WORKLOAD, "--data.len_tail_frac=0.25",
             *pin)
    assert [r["step"] for r in metrics(run)] == list(range(1, 7))
    lengths = long_tail(run)
    assert lengths["max"] >= 20 and lengths["median"] <= 5, lengths
    report = check_log(run)
    assert report["off_policy"] == [] and report["twice"] == [] and report["lost"] == [], report
    assert report["trained_groups"] > 0
    if "tail" in preset or preset == "rollpacker":
        assert report["dropped"] > 0  # over-provisioned rounds abort their stragglers


def long_tail(run: Path) -> dict:
    """Response lengths on the event log: every sample within its prompt's cap (answer + EOS), a heavy tail."""
    events = event_rows(run / "events.jsonl")
    lengths = sorted(e["data"]["tokens"] for e in events if e["kind"] == "trajectory_finished")
    assert lengths and lengths[-1] <= 33
    return {"max": lengths[-1], "median": lengths[len(lengths) // 2], "n": len(lengths)}


def check_log_bounded(run: Path, eta: int) -> dict:
    """The off-policy variant of `check_log`: every trained sample's staleness (trainer version at train_started
    minus the version of the engine it was FIRST admitted to, StaleFlow's V_traj: an upper bound of the per-token
    staleness) is at most eta; no group trained twice; nothing finished lost."""
    events = event_rows(run / "events.jsonl")
    first: dict[int, tuple[int, int]] = {}
    for e in events:
        if e["kind"] == "request_admitted" and e["req_id"] not in first:
            first[e["req_id"]] = (e["group_id"], e.get("version", -1))
    dropped = {e["req_id"] for e in events if e["kind"] == "trajectory_aborted" and not e["data"].get("requeue")}
    reqs_of: dict[int, list[int]] = {}
    for rid, (g, _) in first.items():
        reqs_of.setdefault(g, []).append(rid)
    trained: Counter[int] = Counter()
    too_stale, staleness = [], Counter()
    for e in events:
        if e["kind"] == "train_started":
            for g in e["data"]["groups"]:
                trained[g] += 1
                for rid in reqs_of.get(g, []):
                    if rid not in dropped:
                        s = e.get("version", 0) - first[rid][1]
                        staleness[s] += 1
                        if s > eta:
                            too_stale.append((g, rid, s))
    return {"too_stale": too_stale, "twice": [g for g, n in trained.items() if n > 1],
            "staleness": dict(staleness), "trained_groups": len(trained),
            "interrupted": sum(1 for e in events if e["kind"] == "trajectory_interrupted")}


@pytest.mark.parametrize("preset,eta", [("staleflow", 3), ("areal", 3)])
def test_bounded_staleness_preset_runs_on_real_ranks_within_its_bound(preset, eta, tmp_path):
    run = tmp_path / preset
    torchrun(3, f"--log.dir={run}", f"--sched.preset={preset}", "--cluster.rollout_ranks=2", "--train.steps=6",
             "--rollout.prompts_per_step=8", "--checkpoint.export_hf=false")
    assert [r["step"] for r in metrics(run)] == list(range(1, 7))
    report = check_log_bounded(run, eta)
    assert report["too_stale"] == [] and report["twice"] == [] and report["trained_groups"] == 6 * 8, report
    assert max(report["staleness"]) > 0            # it did run off-policy
    rows = event_rows(run / "events.jsonl")
    progress = [e["data"]["progress"] for e in rows if e["kind"] == "tokens_decoded" and "progress" in e["data"]]
    assert bool(progress) == (preset == "staleflow")   # its snapshot reads each request's tokens so far (Eq. 1)
    j = next(j for j, e in enumerate(rows) if e["kind"] == "train_started" and e.get("version", 0) >= 1)
    rows[j]["version"] = rows[j].get("version", 0) + eta + 1   # the checker catches a sample past the bound
    (run / "events.jsonl").write_text("\n".join(json.dumps(e) for e in rows) + "\n")
    assert check_log_bounded(run, eta)["too_stale"]


def test_staleflow_staleness_manager_aborts_run_on_real_ranks(tmp_path):
    """Redundancy and the uniform-reward filter (§4.3, Fig. 8b-c) on real ranks: rounds of G + 2 samples, every
    batch still 8 whole groups of G within the bound, the surplus and the filtered groups aborted, never trained."""
    run = tmp_path / "staleflow"
    torchrun(3, f"--log.dir={run}", "--sched.preset=staleflow", "--cluster.rollout_ranks=2", "--train.steps=4",
             "--rollout.prompts_per_step=8", "--checkpoint.export_hf=false", "--sched.dispatch.batch_redundancy=0.25",
             "--sched.dispatch.group_redundancy=0.25", "--sched.dispatch.filter_uniform=true")
    assert [r["step"] for r in metrics(run)] == list(range(1, 5))
    report = check_log_bounded(run, 3)
    assert report["too_stale"] == [] and report["twice"] == [] and report["trained_groups"] == 4 * 8, report
    stats = json.loads((run / "summary.json").read_text())["policy_stats"]["dispatch"]
    assert stats["surplus_samples"] > 0 and stats["surplus_groups"] + stats["filtered_uniform"] > 0, stats
    events = event_rows(run / "events.jsonl")
    G = next(e["data"]["group_size"] for e in events if e["kind"] == "round_started")
    dropped = {e["req_id"] for e in events if e["kind"] == "trajectory_aborted"}
    scored: dict[int, list[float]] = {}
    for e in events:
        if e["kind"] == "reward_scored" and e["req_id"] not in dropped:
            scored.setdefault(e["group_id"], []).append(e["data"]["reward"])
    trained = [g for e in events if e["kind"] == "train_started" for g in e["data"]["groups"]]
    assert G == 10 and all(len(scored[g]) == 8 and len(set(scored[g])) > 1 for g in trained)


def test_the_log_checker_catches_an_off_policy_sample_and_a_double_handoff(tmp_path):
    """On a synchronous run's log (the simulator's: the same events as a real run's, in a run directory)."""
    from sim.run import simulate
    run = simulate("sync", "cpu_tiny", "cpu_tiny", 2, 2, steps=2, group_size=4, prompts_per_step=4).write(
        tmp_path / "sync", timeline=False)
    assert check_log(run)["off_policy"] == []
    lines = (run / "events.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    i = next(i for i, e in enumerate(rows) if e["kind"] == "reward_scored" and e["version"] == 1)
    rows[i]["version"] = 0                                   # a sample of round 1 generated by version 0
    j = next(j for j, e in enumerate(rows) if e["kind"] == "train_started")
    rows.insert(j + 1, rows[j])                              # the same groups handed over twice
    (run / "events.jsonl").write_text("\n".join(json.dumps(e) for e in rows) + "\n")
    report = check_log(run)
    assert len(report["off_policy"]) == 1 and report["twice"]


OFF_POLICY = [("one_step", 1), ("streamrl_async", 1), ("partial_rollout", None), ("pipelinerl", None),
              ("windowed_fifo", None), ("pacing", 2), ("april", None), ("adaptive_concurrency", None)]


@pytest.mark.parametrize("preset,bound", OFF_POLICY)
def test_offpolicy_preset_runs_on_real_ranks_and_keeps_the_invariants(preset, bound, tmp_path):
    """Off-policy presets: samples may be older than the step (bounded where the preset says so: pacing's K = 2),
    but no group is trained twice or before it materialised, no finished sample of a trained group is missing, and
    every interrupted request comes back (tests/support/offpolicy_log.py). Laminar's real-rank runs (a full buffer,
    forced repacks, a failed engine) follow, each with the same checks."""
    run = tmp_path / preset
    torchrun(3, f"--log.dir={run}", f"--sched.preset={preset}", "--cluster.rollout_ranks=2", "--train.steps=6",
             "--rollout.prompts_per_step=8", "--checkpoint.export_hf=false")
    assert [r["step"] for r in metrics(run)] == list(range(1, 7))
    events = event_rows(run / "events.jsonl")
    report = check_offpolicy_log(events, bound)
    assert report["twice"] == report["lost"] == report["unreturned"] == report["stale"] == [], report
    assert report["unmaterialised_trained"] == [] and report["trained_groups"] > 0, report


def test_laminar_with_a_full_experience_buffer_evicts_on_real_ranks_and_keeps_the_invariants(tmp_path):
    """Laminar's buffer capped at one batch (`handoff.capacity`): the two engines out-produce the trainer, so
    whole materialised groups are evicted (aborted, counted), none of them trained, every step still gets its batch
    and the off-policy invariants hold. The trainer is slowed at steps 2 and 4 (a train rank sleeps 0.3 s at each
    progress report): the tiny model's train step alone (~0.1 s) is sometimes faster than the engines' batches, and
    then nothing would ever be evicted."""
    run = tmp_path / "laminar"
    torchrun(4, f"--log.dir={run}", "--sched.preset=laminar", "--cluster.rollout_ranks=2", "--train.steps=6",
             "--rollout.prompts_per_step=8", "--checkpoint.export_hf=false", "--sched.handoff.capacity=8",
             env={"TIDAL_FAULTS": "slow 1 train 2 0.3 & slow 1 train 4 0.3"})
    assert [r["step"] for r in metrics(run)] == list(range(1, 7))
    events = event_rows(run / "events.jsonl")
    report = check_offpolicy_log(events, None)
    assert report["twice"] == report["lost"] == report["unreturned"] == report["stale"] == [], report
    evicted = {e["group_id"] for e in events if e["kind"] == "trajectory_aborted"}
    trained = [g for e in events if e["kind"] == "train_started" for g in e["data"]["groups"]]
    assert evicted and not evicted & set(trained) and len(trained) == 6 * 8


@pytest.mark.parametrize("migrate_kv,colocate", [(True, False), (False, False), (True, True)])
def test_laminar_repack_moves_kv_on_real_ranks_or_re_prefills_when_switched_off(migrate_kv, colocate, tmp_path):
    """Laminar's repack forced often (bench/results/cpu-runtime.md "Migrated KV on real ranks"): with
    `perf.migrate_kv` the migrated trajectories carry their KV and the resuming engines adopt it as cached; switched
    off, none carries KV, nothing is adopted and the resuming engines re-prefill. Either way every step trains and the
    off-policy invariants hold; in colocated mode too (2 ranks, each an engine and a trainer shard). The repack monitor
    runs every 10 ms: on a fast host a round's tail lasts less than its old 50 ms period, and colocated runs saw 0-186
    migrations (three runs) where every run now sees ~200."""
    run = tmp_path / "laminar"
    ranks = ["--cluster.colocate=true", "--cluster.world_size=2"] if colocate else ["--cluster.rollout_ranks=2"]
    torchrun(2 if colocate else 4, f"--log.dir={run}", "--sched.preset=laminar", *ranks, "--train.steps=6",
             "--rollout.prompts_per_step=8", "--checkpoint.export_hf=false", "--data.task=repeat",
             "--data.cap_at_answer=true", "--rollout.max_new_tokens=33", "--data.len_body_max=4",
             "--data.len_tail_min=24", "--data.len_tail_max=32", "--data.len_tail_frac=0.25",
             "--sched.rebalance.period_s=0.01", "--sched.rebalance.idle_rule=drained",
             f"--perf.migrate_kv={str(migrate_kv).lower()}")
    assert [r["step"] for r in metrics(run)] == list(range(1, 7))
    events = event_rows(run / "events.jsonl")
    report = check_offpolicy_log(events, None)
    assert report["twice"] == report["lost"] == report["unreturned"] == report["stale"] == [], report
    migrated = [e for e in events if e["kind"] == "trajectory_migrated"]
    interrupted = [e for e in events if e["kind"] == "trajectory_interrupted"]
    with_kv = [e for e in interrupted if (e.get("data") or {}).get("kv_tokens")]
    last = {}
    for e in events:
        if e["kind"] == "tokens_decoded":
            last[e["rank"]] = e["data"]
    adopted = sum(d["kv_adopted"] for d in last.values())
    assert migrated, "the forced repack never fired"
    if migrate_kv:
        assert with_kv and adopted > 0
    else:
        assert not with_kv and adopted == 0 and sum(d["prefill"] for d in last.values()) > 0
    from bench.kv_move import summarize   # the bench's reading of the same log
    s = summarize(run, migrate_kv)
    assert (s.migrations, s.adopted) == (len(migrated), adopted) and (s.kv_tokens > 0) == migrate_kv


def test_laminar_isolates_an_engine_failure_on_real_ranks_and_loses_nothing(tmp_path):
    """Laminar §3.3 on 2 train + 2 rollout ranks: rank 2's engine fails mid-generation (an injected fault at its
    20th engine step, unrebuildable for 1 s). The run goes on: its trajectories resume from the partial-response
    pool on the other engine, of their own version, and all finish; the engine rejoins and takes new batches; every
    step trains, nothing is dropped, and the off-policy invariants hold. (Responses run to their 24-32 token caps,
    so the fault lands mid-batch, after two streams.) Train rank 0 sleeps 0.8 s at each progress report of step 3,
    so the run outlasts the engine's second of downtime on any host (on a fast one the six steps it ran before took
    0.9 s in all, and the engine had nothing left to rejoin)."""
    run = tmp_path / "laminar"
    env = {"TIDAL_FAULTS": "fail 2 decode 20 1.0 & slow 0 train 3 0.8"}
    torchrun(4, f"--log.dir={run}", "--sched.preset=laminar", "--cluster.rollout_ranks=2", "--train.steps=8",
             "--rollout.prompts_per_step=8", "--checkpoint.export_hf=false", "--data.task=repeat",
             "--data.cap_at_answer=true", "--rollout.max_new_tokens=33", "--data.len_body_max=4",
             "--data.len_tail_min=24", "--data.len_tail_max=32", "--data.len_tail_frac=1.0",
             "--perf.ignore_eos=true", env=env)
    assert [r["step"] for r in metrics(run)] == list(range(1, 9))
    events = event_rows(run / "events.jsonl")
    report = check_offpolicy_log(events, None)
    assert report["twice"] == report["lost"] == report["unreturned"] == report["stale"] == [], report
    assert report["unmaterialised_trained"] == [] and report["trained_groups"] == 8 * 8, report
    kinds = [e["kind"] for e in events]
    i, j = kinds.index("engine_failed"), kinds.index("engine_recovered")
    failed, recovered, rec = events[i], events[j], events[kinds.index("trajectories_recovered")]
    assert kinds.count("engine_failed") == 1 and failed["engine"] == 0 and "injected" in failed["data"]["error"]
    held = {int(r): n for r, n in failed["data"]["held"].items()}
    assert held and rec["data"]["resumed"] == len(held) and rec["data"]["dropped"] == 0
    # the pool kept all but what the engine generated since its last stream (every 8 engine steps)
    assert rec["data"]["tokens_kept"] >= 16 * len(held) and rec["data"]["tokens_lost"] <= 8 * len(held), rec
    assert recovered["data"]["down_s"] >= 1.0 and not [e for e in events if e["kind"] == "trajectory_aborted"]
    again = [e for e in events[i:] if e["kind"] == "request_admitted" and e["req_id"] in held]
    assert sorted(e["req_id"] for e in again) == sorted(held)
    assert all(e["version"] == failed["version"] for e in again), "resumed on an engine of another version"
    finished = {e["req_id"]: e for e in events[i:] if e["kind"] == "trajectory_finished" and e["req_id"] in held}
    assert set(finished) == set(held) and all(finished[r]["data"]["tokens"] >= held[r] - 1 for r in held)
    assert any(e["kind"] == "request_admitted" and e["engine"] == 0 for e in events[j:]), "the engine never rejoined"


def groups_started(events: list[dict]) -> list[tuple[int, int]]:
    """(group, version of the engine it was first admitted to), in the order groups started."""
    seen: dict[int, int] = {}
    for e in events:
        if e["kind"] == "request_admitted" and e["group_id"] not in seen:
            seen[e["group_id"]] = e.get("version", -1)
    return list(seen.items())


def test_pipelinerl_keeps_the_running_kv_across_loads_on_real_ranks_where_an_areal_load_recomputes_it(tmp_path):
    """PipelineRL's in-flight update on real ranks: engines adopt new weights while sequences run, and every running
    sequence keeps its KV (the engine's own count after the load, `weights_loaded`'s kept_kv); the actors' max_lag
    admission cap holds for every group (the i-th group started on an engine at version u: i < (lag + u + 1) x P).
    The same run under AReaL's weight sync (`--sched.weight_sync=areal`) recomputes: no running sequence keeps it."""
    P, lag = 8, 4                                          # configs/sched/pipelinerl.toml's max_lag
    for ws in ("in_flight", "areal"):
        run = tmp_path / ws
        torchrun(3, f"--log.dir={run}", "--sched.preset=pipelinerl", f"--sched.weight_sync={ws}",
                 "--cluster.rollout_ranks=2", "--train.steps=6", f"--rollout.prompts_per_step={P}",
                 "--checkpoint.export_hf=false", *WORKLOAD, "--data.len_tail_frac=0.25")
        events = event_rows(run / "events.jsonl")
        loads = [e["data"] for e in events if e["kind"] == "weights_loaded" and e["data"].get("running", 0) > 0]
        assert loads, f"{ws}: no load found a sequence running: the check would be vacuous"
        assert all(d["kept_kv"] == (d["running"] if ws == "in_flight" else 0) for d in loads), (ws, loads)
        report = check_offpolicy_log(events)
        assert report["twice"] == report["lost"] == report["unreturned"] == [], report
        if ws == "in_flight":
            for i, (_, u) in enumerate(groups_started(events)):
                assert i < (lag + u + 1) * P, (i, u)


def test_windowed_fifo_lets_younger_groups_overtake_a_straggler_on_real_ranks_but_never_more_than_w_minus_1(
        tmp_path):
    """Windowed FIFO on real ranks, on the long-tail workload: younger groups do overtake a straggler (the check is
    not vacuous: with P = 4 and W = 3 a batch could never form around a straggler before the trainer's next call,
    and every run was strict FIFO), never more than W - 1 of them, and no sample is trained more than
    S + ceil((W - 1) / P) versions after it started (the source's bound)."""
    W, P, S = 3, 2, 2
    run = tmp_path / "windowed_fifo"
    torchrun(3, f"--log.dir={run}", "--sched.preset=windowed_fifo", f"--sched.handoff.window={W}",
             f"--sched.dispatch.lag={S}", "--cluster.rollout_ranks=2", "--train.steps=16",
             f"--rollout.prompts_per_step={P}", "--checkpoint.export_hf=false", *WORKLOAD, "--data.len_tail_frac=0.25")
    events = event_rows(run / "events.jsonl")
    order = [g for e in events if e["kind"] == "train_started" for g in e["data"]["groups"]]
    over = {g: sum(1 for other in order[:i] if other > g) for i, g in enumerate(order)}
    assert sum(over.values()) > 0, "no group was overtaken: the bound below would be vacuous"
    assert max(over.values()) <= W - 1, over
    report = check_offpolicy_log(events, S + -(-(W - 1) // P))
    assert report["stale"] == report["twice"] == report["lost"] == [], report


def test_adaptive_concurrency_cuts_its_cap_when_a_small_kv_pool_preempts_on_real_ranks(tmp_path):
    """prime-rl's adaptive concurrency on real ranks, with a KV pool too small for a batch (512 tokens an engine)
    and polls every 10 ms (the preset's 5 s is longer than this run): the engines preempt, the cap is cut (HARD) below
    the first step's one batch and never below a group, and the requests in flight never exceed the highest cap."""
    P, G = 8, 8                                            # tiny.toml's group size
    run = tmp_path / "adaptive_concurrency"
    torchrun(3, f"--log.dir={run}", "--sched.preset=adaptive_concurrency", "--sched.dispatch.poll_s=0.01",
             "--cluster.rollout_ranks=2", "--train.steps=6", f"--rollout.prompts_per_step={P}",
             "--checkpoint.export_hf=false", *WORKLOAD, "--data.len_tail_frac=0.25", "--rollout.kv_cache_tokens=512")
    events = event_rows(run / "events.jsonl")
    assert max(e["data"].get("preemptions", 0) for e in events if e["kind"] == "tokens_decoded") > 0
    stats = next(e["data"]["dispatch"] for e in events if e["kind"] == "policy_stats")
    assert stats["hard_cuts"] >= 1 and G <= stats["n_max_low"] < P * G, stats
    in_flight = peak = 0
    for e in events:
        in_flight += {"request_admitted": 1, "trajectory_finished": -1, "trajectory_interrupted": -1,
                      "trajectory_aborted": -1}.get(e["kind"], 0)
        peak = max(peak, in_flight)
    assert 0 < peak <= stats["n_max_high"], (peak, stats)
    report = check_offpolicy_log(events)
    assert report["twice"] == report["lost"] == report["unreturned"] == [], report

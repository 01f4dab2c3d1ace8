"""Presets through the simulator: invariants from the event log, determinism, scale, and the CLIs."""
import json

import pytest

import sched
from sim import simulate
from sim import compare, repro
from sim.repro import core
from sim.calibrate import measure
from sim.check import on_policy_report


def run(seed=0, engines=3, steps=3, prompts=6, g=4, **kw):
    return simulate("sync", "rollpacker_7b_8k", "h800_7b", num_engines=engines, train_gpus=4, steps=steps,
                    group_size=g, prompts_per_step=prompts, seed=seed, **kw)


@pytest.mark.parametrize("seed,engines", [(0, 1), (1, 3), (2, 5)])
def test_sync_preset_is_on_policy_loses_nothing_and_has_sane_metrics(seed, engines):
    r = run(seed, engines, counters_every_s=2.0, progress=True)
    rep = on_policy_report(r.events)
    assert rep["off_policy"] == [] and rep["trained_twice"] == [] and rep["finished_not_trained"] == []
    assert rep["trained"] == 3 * 6 * 4
    m = r.metrics
    assert 0 < m["trainer_wait_ratio"] < 1 and 0 < m["engine_idle_ratio"] < 1
    assert m["staleness"] == {0: 3 * 6} and m["dropped"] == 0
    assert m["samples_per_s"] > 0 and m["rollout_to_train_end_s"] > 0 and m["weight_sync_s"] > 0
    first = r.events[0]
    assert first.kind == "version_published" and first.version == 0 and first.t == 0
    done = [e for e in r.events if e.kind == "train_step_done"]
    assert [e.version for e in done] == [1, 2, 3]
    assert all(e.data["stepped"] and 0 <= e.data["reward_mean"] <= 1 and e.data["samples"] == 24 for e in done)
    assert any(e.kind == "tokens_decoded" and e.data.get("progress") for e in r.events)


def test_engine_counters_come_on_the_clock_ticks_and_leave_the_simulation_unchanged():
    """Counters are read from the engines' lazy state at each tick k x period (one batch per tick), and at an
    engine's going idle; reading them cuts no segment, so a preset that decides only on what happens (sync) logs
    exactly the same events with and without them. Per engine the reported totals add up, and a request's reported
    progress never goes back and never passes its final length."""
    plain, counted = run(1), run(1, counters_every_s=0.5, progress=True)
    assert [e.to_json() for e in plain.events] == [e.to_json() for e in counted.events if e.kind != "tokens_decoded"]
    reports = [e for e in counted.events if e.kind == "tokens_decoded"]
    idle = {(e.engine, e.t) for e in counted.events if e.kind == "engine_idle"}
    assert len(reports) > 20
    for e in reports:
        assert abs(e.t / 0.5 - round(e.t / 0.5)) < 1e-9 or (e.engine, e.t) in idle
    final = {e.req_id: e.data["tokens"] for e in counted.events if e.kind == "trajectory_finished"}
    seen: dict[int, int] = {}
    for eng in {e.engine for e in reports}:
        mine = [e for e in reports if e.engine == eng]
        assert [e.data["total"] for e in mine] == sorted(e.data["total"] for e in mine)
        assert sum(e.data["tokens"] for e in mine) == mine[-1].data["total"]
    for e in reports:
        for rid, n in e.data["progress"].items():
            assert n >= seen.get(rid, 0) and n <= final[rid]
            seen[rid] = n


def test_same_seed_same_event_log_other_seed_differs():
    a, b, c = run(7), run(7), run(8)
    assert [e.to_json() for e in a.events] == [e.to_json() for e in b.events]
    assert [e.to_json() for e in a.events] != [e.to_json() for e in c.events]


def test_colocated_engines_never_decode_while_the_trainer_works():
    from sched.metrics import engine_spans, trainer_spans
    r = run(0, engines=4, colocated=True)
    end = max(e.t for e in r.events)
    train = trainer_spans(r.events)
    for spans in engine_spans(r.events, end).values():
        for a, b in spans:
            assert all(b <= s + 1e-9 or a >= e - 1e-9 for s, e, _ in train)
    assert r.gpus == 4


def test_samples_budget_stops_the_run_and_events_write_like_a_real_run(tmp_path):
    r = simulate("sync", "cpu_tiny", "cpu_tiny", 1, 3, steps=10**9, group_size=8, prompts_per_step=4, samples=64)
    assert r.metrics["samples_trained"] == 64
    out = r.write(tmp_path / "run")
    assert (out / "events.jsonl").is_file() and (out / "timeline.png").is_file()
    assert json.loads((out / "summary.json").read_text())["samples_trained"] == 64


def test_scale_1024_gpus_a_thousand_prompt_round():
    # 512 engines (TP 1) + 512 train GPUs; 1000 prompts x G=8 = 8000 samples, RollPacker 7B/8k lengths
    r = simulate("sync", "rollpacker_7b_8k", "h800_7b", num_engines=512, train_gpus=512, steps=1, group_size=8,
                 prompts_per_step=1000, seed=0)
    print(f"\nscale: 1024 GPUs, 8000 samples, {len(r.events)} events simulated in {r.wall_s:.2f} s "
          f"(virtual makespan {r.metrics['makespan_s']:.0f} s)")
    assert r.gpus == 1024 and r.metrics["samples_per_s"] > 0
    assert sum(e.kind == "trajectory_finished" for e in r.events) == 8000
    assert r.wall_s < 20.0


# ------------------------------------------------------------------------------------------------------- CLIs
def test_compare_json_rows(capsys):
    assert compare.main(["--json", "--gpus", "16", "--rounds", "1", "--prompts", "16", "--no-plots"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["preset"] for r in rows] == compare.presets() and "sync" in compare.presets()
    sync = next(r for r in rows if r["preset"] == "sync")
    assert set(sync) == set(compare.KEYS) and sync["throughput"] > 0 and 0 < sync["trainer_wait_ratio"] < 1


def test_compare_shows_a_failing_preset_as_a_row(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(compare, "presets", lambda: ["sync", "no_such_preset"])
    assert compare.main(["--gpus", "4", "--rounds", "1", "--prompts", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no_such_preset    FAILED: ValueError" in out and (tmp_path / "sync.png").is_file()


def test_compare_runs_chosen_presets_with_sched_overrides(capsys, monkeypatch):
    """`--presets a,b` picks presets; `--sched.KIND=NAME` / `--sched.KIND.PARAM=V` change their mechanisms, read as
    train.py reads them (one policy in the simulator without a preset file)."""
    ran = []

    def recording(preset, *a, **kw):
        ran.append(preset)
        return simulate(preset, *a, **kw)
    monkeypatch.setattr(compare, "simulate", recording)
    small = ["--json", "--gpus", "4", "--rounds", "1", "--prompts", "4", "--no-plots"]
    assert compare.main([*small, "--presets", "sync,one_step", "--sched.dispatch=fewest_tokens",
                         "--sched.dispatch.max_groups_per_call=2"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["preset"] for r in rows] == ["sync", "one_step"] and all("error" not in r for r in rows), rows
    assert [(p.dispatch.name, p.dispatch.p.max_groups_per_call) for p in ran] == [("fewest_tokens", 2)] * 2
    assert ran[0].update.name == "step_publish" and ran[1].handoff.name == "oldest_round"   # the rest: the file
    ran.clear()
    assert compare.main([*small, "--presets", "sync"]) == 0 and ran == ["sync"]      # no overrides: the file as is
    capsys.readouterr()
    for bad, says in ((["--sched.dispatch=psychic"], "'psychic' is not a registered dispatch"),
                      (["--sched.dispatch.max_groups_per_call=2"], "sched.dispatch 'fifo' takes no parameters"),
                      (["--train.lr=1"], "unrecognized argument '--train.lr=1'"),
                      (["--sched.preset=laminar"], "unrecognized argument '--sched.preset=laminar'")):
        assert compare.main([*small, "--presets", "sync", *bad]) == 2
        assert says in capsys.readouterr().err, bad
    with pytest.raises(SystemExit):
        compare.main([*small, "--presets", "sync,nope"])
    assert "no configs/sched/<name>.toml for nope" in capsys.readouterr().err


def test_compare_replays_a_trace(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_len": 20, "response_lens": [5, 50]}) for _ in range(4)))
    assert compare.main(["--json", "--gpus", "4", "--rounds", "1", "--prompts", "4", "--group-size", "2",
                         "--trace", str(trace), "--no-plots"]) == 0
    rows = {r["preset"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["sync"]["throughput"] > 0
    # exactly G responses per prompt in the trace: the speculative presets (ceil(1.25 G) per prompt) run too
    assert all("error" not in r and r["throughput"] > 0 for r in rows.values()), rows
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_len": 3}\n')
    assert compare.main(["--trace", str(bad), "--no-plots"]) == 2
    assert "bad.jsonl:1: field 'response_lens' is missing" in capsys.readouterr().err


def test_repro_counts_hits_under_the_stricter_rule_across_seeds(capsys, monkeypatch):
    rows = [repro.Row("a point", (2.0, 2.0), "2x", lambda runs: 2.3, "{:.1f}"),
            repro.Row("a range", (0.47, 0.52), "47-52%", lambda runs: 0.30),
            repro.Row("a null speedup", (1.12, 2.12), "1.12-2.12x", lambda runs: 1.00, "{:.2f}x", kind=repro.SPEEDUP),
            repro.Row("a seeded speedup", (1.12, 2.12), "1.12-2.12x", lambda runs: 1.0 + 0.1 * (runs.seed + 1),
                      "{:.2f}x", kind=repro.SPEEDUP, setting="engines + trainer"),
            repro.Row("arithmetic", (0.0, 10.0), "< 10 s", lambda runs: 14.5, "{:.1f} s", kind=repro.ARITHMETIC),
            repro.Row("needs a policy", (1.0, 1.0), "1x", lambda runs: None),
            repro.Row("breaks", (1.0, 1.0), "1x", lambda runs: 1 / 0)]
    monkeypatch.setitem(repro.PAPERS, "rolloutpipe", repro.Paper(rows, components="simulated: a; not: b"))
    assert repro.main(["rolloutpipe", "--seeds", "0,1,2", "--jobs", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1] == "simulated: a; not: b" and lines[2] == "figure | ours | paper | hit (margin) | setting"
    # 2.3 against [1.6, 2.4]: 4% below the upper end; 0.30 against [0.376, 0.624]: 20% below the lower end
    assert lines[3] == "a point | 2.3 | 2x | yes (+4%)" and lines[4].endswith("| no (-20%)")
    assert lines[5] == "a null speedup | 1.00x | 1.12-2.12x | no (-6%)"   # inside 0.8 x 1.12, but no gain: a miss
    # mean 1.20x over seeds 0-2 (1.10, 1.20, 1.30): gain 0.20 >= half of 0.12; 1.20 / 1.06 - 1 = 13% inside
    assert lines[6] == "a seeded speedup | 1.20x [1.10x, 1.30x] | 1.12-2.12x | yes (+13%) | engines + trainer"
    assert lines[7] == "arithmetic | 14.5 s (arithmetic) | < 10 s | n/a"
    assert "policy not available yet" in lines[8] and "failed: ZeroDivisionError" in lines[9]
    assert lines[-1] == "rolloutpipe: 2/6 headline figures within 20%; 1 arithmetic row not counted"


def test_repro_puts_edge_compensating_caveated_and_bound_rows_apart(capsys, monkeypatch):
    rows = [repro.Row("step A", (1.10, 1.10), "1.10x", lambda runs: 1.00, "{:.2f}x", kind=repro.SPEEDUP),
            repro.Row("step B", (1.20, 1.20), "1.20x", lambda runs: 1.30, "{:.2f}x", kind=repro.SPEEDUP),
            repro.Row("total", (1.32, 1.32), "1.32x", lambda runs: 1.30, "{:.2f}x", kind=repro.SPEEDUP,
                      parts=("step A", "step B")),
            repro.Row("at the edge", (0.50, 0.50), "50%", lambda runs: 0.595),
            repro.Row("trainer-bound", (1.33, 1.33), "1.33x", lambda runs: 1.33, "{:.2f}x", kind=repro.SPEEDUP,
                      caveat="trainer-bound: the ratio of train GPUs"),
            repro.Row("up to", (1.0, 1.5), "<= 1.5x", lambda runs: 1.0, "{:.2f}x", kind=repro.BOUND),
            repro.Row("at most", (0.0, 4.0), "<= 4", lambda runs: 6.0, "{:.0f}", kind=repro.BOUND)]
    monkeypatch.setitem(repro.PAPERS, "rolloutpipe", repro.Paper(rows))
    assert repro.main(["rolloutpipe", "--seeds", "0", "--jobs", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    marks = {ln.split(" | ")[0]: ln.split(" | ")[3] for ln in lines[2:-1]}
    assert marks["step A"].startswith("no") and marks["step B"].startswith("yes")
    assert marks["total"] == "weak (+12%): compensating: step A miss"
    assert marks["at the edge"] == "weak (+1%): edge"           # 0.595 against 0.60: 0.8% inside
    assert marks["trainer-bound"] == "weak (+14%): trainer-bound: the ratio of train GPUs"
    assert marks["up to"] == "holds (+25%), bound" and marks["at most"] == "fails (-25%), bound"
    assert lines[-1] == ("rolloutpipe: 1/5 headline figures within 20%, 3 more weak (1 edge, 1 compensating, "
                         "1 caveat); 1/2 bound rows hold, not counted")


def test_a_row_names_only_rows_of_its_paper_as_parts_and_a_known_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        repro.Row("x", (1, 1), "1", lambda runs: 1, kind="upto")
    rows = [repro.Row("total", (1, 1), "1", lambda runs: 1, parts=("nope",))]
    with pytest.raises(ValueError, match="parts name no row of the paper: \\['nope'\\]"):
        core.verdicts(rows, [[1.0]])


def test_hit_rule():
    level = repro.Row("r", (0.47, 0.52), "", lambda runs: 0)
    fast = repro.Row("s", (1.12, 2.12), "", lambda runs: 0, kind=repro.SPEEDUP)
    assert repro.judge(level, 0.8 * 0.47) and repro.judge(level, 1.2 * 0.52) and not repro.judge(level, 0.37)
    assert not repro.judge(fast, 1.00) and not repro.judge(fast, 1.05) and repro.judge(fast, 1.06)
    assert not repro.judge(fast, 2.60)
    assert repro.judge(repro.Row("a", (0, 1), "", lambda runs: 0, kind=repro.ARITHMETIC), 5.0) is None
    assert repro.margin(level, 0.8 * 0.47) == pytest.approx(0.0) and repro.margin(fast, 1.06) == pytest.approx(0.0)
    assert repro.margin(repro.Row("b", (0, 4), "", lambda runs: 0, kind=repro.BOUND), 0.0) == pytest.approx(1.0)


def test_repro_train_speed_is_a_labelled_sensitivity_that_restores_the_profiles(capsys, monkeypatch):
    from sim.profiles import get_profile
    base = get_profile("h800_laminar_32b").train_s_per_token
    seen = []
    rows = [repro.Row("train cost", (0.0, 1.0), "-",
                      lambda runs: seen.append(get_profile("h800_laminar_32b").train_s_per_token) or 0.5)]
    monkeypatch.setitem(repro.PAPERS, "laminar", repro.Paper(rows, seeds=1))
    assert repro.main(["laminar", "--train-speed", "2"]) == 0
    assert seen and all(x == pytest.approx(base / 2) for x in seen)   # (the pool computes a row more than once)
    assert get_profile("h800_laminar_32b").train_s_per_token == base      # restored for the next caller
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "laminar: 1/1 headline figures within 20% (sensitivity run: training 2x faster per token)")
    with pytest.raises(SystemExit):
        repro.main(["laminar", "--train-speed", "0"])
    assert "--train-speed must be > 0" in capsys.readouterr().err


def test_repro_prefill_cost_scales_every_prefill_with_the_training_speed_and_says_so(capsys, monkeypatch):
    from sim.profiles import get_profile
    base = get_profile("h800_laminar_32b")
    seen = []
    rows = [repro.Row("costs", (0.0, 1.0), "-", lambda runs: seen.append(
        (get_profile("h800_laminar_32b").prefill_s_per_token, get_profile("h800_laminar_32b").train_s_per_token))
        or 0.5)]
    monkeypatch.setitem(repro.PAPERS, "laminar", repro.Paper(rows, seeds=1))
    assert repro.main(["laminar", "--prefill-cost", "3", "--train-speed", "4"]) == 0
    assert seen and all(p == pytest.approx(3 * base.prefill_s_per_token)
                        and t == pytest.approx(base.train_s_per_token / 4) for p, t in seen)
    assert get_profile("h800_laminar_32b").prefill_s_per_token == base.prefill_s_per_token
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "laminar: 1/1 headline figures within 20% (sensitivity run: training 4x faster per token, prefill 3x the "
        "seconds per token)")
    with pytest.raises(SystemExit):
        repro.main(["laminar", "--prefill-cost", "-1"])
    assert "--prefill-cost must be > 0" in capsys.readouterr().err


def calibrated(tmp_path, reports: list[tuple[int, int]], k3: float, k4: float, carry_steps: bool) -> dict:
    """sim.calibrate's figures of a run whose engine reported (batch n, steps since the last report) pairs, each
    step taking k3 * n + k4 seconds; the reports carry the worker's step count or not (runs before it was sent)."""
    lines, t, total, steps = [{"kind": "engine_busy", "t": 0.0, "engine": 0, "rank": 1}], 0.0, 0, 0
    for n, gap in reports:
        t += gap * (k3 * n + k4)
        total, steps = total + gap * n, steps + gap
        lines.append({"kind": "tokens_decoded", "t": t, "engine": 0, "rank": 1,
                      "data": {"total": total, **({"steps": steps} if carry_steps else {})}})
    lines.append({"kind": "trajectory_finished", "t": t, "engine": 0, "rank": 1, "req_id": 0,
                  "data": {"tokens": total}})
    lines.append({"kind": "engine_idle", "t": t, "engine": 0, "rank": 1})
    (tmp_path / "events.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step_time_s": 2.0, "tokens": 1000}) + "\n")
    return measure(tmp_path)


@pytest.mark.parametrize("batches", [[4, 9, 16, 25, 9, 4], [256]])
def test_calibrate_recovers_a_known_step_time(tmp_path, batches):
    """The slope and intercept where the batch size varies; where every step has one batch size (a GPU run whose
    rows stay full) no slope exists: the mean step at that batch, and no k3 / k4 pretending to be a fit."""
    k3, k4 = 5e-5, 2e-3
    m = calibrated(tmp_path, [(n, 8) for n in batches * 3], k3, k4, carry_steps=False)
    if len(batches) > 1:
        assert m["k3"] == pytest.approx(k3, rel=1e-6) and m["k4"] == pytest.approx(k4, rel=1e-6)
    else:
        assert "k3" not in m and "k4" not in m and m["mean_batch"] == 256
        assert m["step_s"] == pytest.approx(k3 * 256 + k4, rel=1e-9)
    assert m["train_s_per_token_one_rank"] == pytest.approx(2.0 / 1000)  # one train rank (the engine's rank)


def test_calibrate_counts_the_steps_between_reports_when_the_events_carry_them(tmp_path):
    """A CPU engine runs up to cpu_decode_steps decode steps a call, so two reports need not be `counters_every`
    steps apart: the worker's step count in each report gives the step time and batch."""
    k3, k4 = 5e-5, 2e-3
    m = calibrated(tmp_path, [(256, 16), (128, 3), (64, 16), (256, 1), (128, 16)] * 2, k3, k4, carry_steps=True)
    assert m["k3"] == pytest.approx(k3, rel=1e-6) and m["k4"] == pytest.approx(k4, rel=1e-6)


@pytest.mark.parametrize("name", compare.presets())
def test_every_preset_runs_in_the_simulator_and_loses_nothing(name):
    r = simulate(name, "rollpacker_7b_8k", "h800_7b", 4, 4, steps=10**9, group_size=8, prompts_per_step=16, seed=0,
                 samples=3 * 16 * 8)
    rep = on_policy_report(r.events)
    done = r.metrics["samples_trained"]       # train calls done when the run stopped; one more may have started
    assert done >= 3 * 16 * 8 and done <= rep["trained"] <= done + 16 * 8
    assert rep["trained_twice"] == []
    p = sched.load_preset(name)
    declared = [b for q in p.policies().values() if (b := q.staleness_bound()) is not None]
    if p.weight_sync.name == "barrier" and not any(declared):  # engines load only when idle: round-level on-policy
        assert rep["off_policy_round"] == [] and rep["finished_not_trained"] == []
    else:  # an asynchronous pipeline always holds work when the run stops: only still-open groups may be untrained
        group_of = {e.req_id: e.group_id for e in r.events if e.kind == "trajectory_finished"}
        stranded = [rid for rid in rep["finished_not_trained"]
                    if group_of[rid] not in r.views.groups or r.views.groups[group_of[rid]].closed]
        assert stranded == []


def test_sim_cli_lists_profiles_and_workloads(capsys):
    from sim.__main__ import main
    assert main(["profiles", "h800_7b"]) == 0 and "StreamRL Table 1" in capsys.readouterr().out
    assert main(["workloads"]) == 0 and "rollpacker_14b_16k" in capsys.readouterr().out
    assert main([]) == 2


def test_compare_reports_progress_per_preset_on_stderr_and_only_the_table_on_stdout(capsys):
    """Each preset takes seconds on the default setting: a line per preset as it ends keeps the run from looking
    hung, on stderr so that stdout stays the table (or the JSON rows) a script reads."""
    assert compare.main(["--json", "--gpus", "4", "--rounds", "1", "--prompts", "4", "--no-plots",
                         "--presets", "sync,one_step"]) == 0
    out, err = capsys.readouterr()
    assert [r["preset"] for r in json.loads(out)] == ["sync", "one_step"]
    lines = err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("[1/2] sync ") and lines[1].startswith("[2/2] one_step "), err
    assert all(line.endswith(" s") and float(line.split()[-2]) >= 0 for line in lines), err

"""sim.validate: each preset's simulated speedup over sync against the one recorded on real ranks (sim/validation/).

The simulator is calibrated from the recorded sync run alone; every expected figure comes from the recorded files.
A preset the simulator is known to miss by more than 15% is an expected failure that names the measured error and
its cause (strict: the test fails when such a preset starts passing, as it does when a passing one breaks).
"""
from __future__ import annotations

import json
import re
import shutil

import pytest

from sim import validate

RECORDED = validate.load_recorded()
PRESETS = [p for p in RECORDED if p != "sync"]

# preset -> why the simulated speedup misses the recorded one by more than 15% (sim/README.md, "Validation against
# our own run", has the table and the causes). Recorded on an idle machine (1-minute load 1.5-3.6, the runs' own);
# the pairs' identical sync runs took 6.43-7.25 s, so one pair's ratio carries ~+-6% of run-to-run noise.
KNOWN_MISSES: dict[str, str] = {}   # error: simulated, measured, cause


@pytest.fixture(scope="module")
def rows() -> dict[str, validate.Row]:
    return {r.preset: r for r in validate.rows(RECORDED)}


def _param(preset: str):
    if preset in KNOWN_MISSES:
        return pytest.param(preset, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[preset]))
    return preset


@pytest.mark.parametrize("preset", [_param(p) for p in PRESETS])
def test_simulated_speedup_within_15_percent_of_the_measured_one(rows, preset):
    r = rows[preset]
    assert abs(r.sim / r.real - 1.0) <= validate.TOLERANCE, (
        f"{preset}: simulated {r.sim:.2f}x against {r.real:.2f}x measured ({r.sim / r.real - 1:+.1%})")


def test_every_preset_is_recorded_with_its_machine_load_date_and_command():
    assert set(RECORDED) == set(validate.presets())
    setting = RECORDED["sync"]["setting"]
    for name, rec in RECORDED.items():
        meta = rec["recorded"]
        assert meta["machine"]["cpus"] and meta["date"] and meta["command"].startswith("python bench/policies.py")
        assert rec["setting"] == setting, f"{name} was recorded in another setting than sync"
        assert len(rec["load_avg_1min"]) == 2 and all(x >= 0 for x in rec["load_avg_1min"])
        assert rec["loop_s"] > 0 and rec["samples"] > 0
        if name != "sync":   # measured against the sync run of its own pair
            assert rec["sync_loop_s"] > 0 and len(rec["sync_load_avg_1min"]) == 2
    assert RECORDED["sync"]["pair"] in PRESETS
    trace = RECORDED["sync"]["trace"]
    assert len(trace) == setting["rounds"] * setting["prompts"]
    assert all(len(lens) == setting["group_size"] for _, lens in trace)


def test_the_simulation_reads_only_the_sync_run(tmp_path, rows):
    """Another preset's recorded figures change its measured speedup, never the simulated one."""
    other = PRESETS[0]
    shutil.copy(validate.VALIDATION_DIR / "sync.json", tmp_path / "sync.json")
    rec = dict(RECORDED[other], loop_s=RECORDED[other]["loop_s"] * 2, response_len_mean=99.0)
    (tmp_path / f"{other}.json").write_text(json.dumps(rec))
    (r,) = validate.rows(validate.load_recorded(tmp_path))
    assert r.sim == pytest.approx(rows[other].sim, rel=1e-12)
    assert r.real == pytest.approx(rows[other].real / 2, rel=1e-12)


def test_the_command_prints_the_table_and_the_count(monkeypatch, capsys, rows):
    monkeypatch.setattr(validate, "rows", lambda recorded: [rows[p] for p in PRESETS])
    assert validate.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "real speedup" in next(line for line in out if line.startswith("preset"))
    for p in PRESETS:
        (line,) = [ln for ln in out if ln.split()[:1] == [p]]
        assert line.split()[-1] == ("yes" if rows[p].within else "NO")
    m = re.fullmatch(r"sim\.validate: (\d+)/(\d+) presets within 15% of the measured speedup over sync", out[-1])
    assert m and int(m[2]) == len(PRESETS) and int(m[1]) == sum(r.within for r in rows.values())


def test_the_recorder_reads_bench_policies_lines_and_writes_json_it_reads_back():
    line = ("  laminar                  loop  10.15 s  (process  34.6 s)  1536 samples  trainer wait 0.00  "
            "load 16.99 -> 17.08")
    with_reward = line.replace("samples  trainer", "samples  reward 0.114  trainer").replace("laminar", "areal  ")
    assert validate.bench_lines(f"header\n{line}\n{with_reward}\n") == {
        "laminar": {"process_s": 34.6, "load_before": 16.99, "load_after": 17.08},
        "areal": {"process_s": 34.6, "load_before": 16.99, "load_after": 17.08}}
    summary = {"preset": "sync", "loop_s": 1.5, "trace": [[4, [1, 2]], [5, [60, 3]]]}
    assert json.loads(validate._dump(dict(summary))) == summary


def test_the_profile_charges_the_trainer_as_sync_calls_split_with_their_optimizer_steps():
    """sync.json's call_split (per call, per minibatch pass, per token, the optimizer step's own) is the simulated
    trainer's cost, a call that only accumulates pays its one pass, the controller's CPU per trajectory stretches
    the calls, and each preset's calls take the optimizer steps bench/policies.py gives it (sync: P / U a call)."""
    cal = RECORDED["sync"]["calibration"]
    cost = validate.profile_from(RECORDED["sync"])
    assert (cost.train_s_per_token, cost.train_overhead_s, cost.train_accumulate_s) == (
        cal["split_s_per_token_one_rank"], cal["split_call_s"], cal["split_pass_s"])
    assert cost.train_step_s == pytest.approx(cal["split_pass_s"] + cal["optimizer_step_s"], rel=1e-12)
    assert 0 < cost.train_overhead_s < cost.train_accumulate_s < cost.train_step_s
    assert 0 < cost.controller_s_per_trajectory == cal["controller_s_per_trajectory"] < 1e-3
    setting = RECORDED["sync"]["setting"]
    assert validate.sim_setting("sync", setting)[2] == setting["prompts"] // setting["batch_groups"]
    assert validate.sim_setting("stream_generation", setting)[2] == 1


def test_the_profile_takes_the_decode_step_and_the_proximal_pass_from_the_sync_run():
    """The decode step is sync's span_fit (its busy spans whole) and decoupled PPO's proximal pass is charged at the
    share of sync's train seconds its forward passes took; each constant names the sync run as its source."""
    cal = RECORDED["sync"]["calibration"]
    cost = validate.profile_from(RECORDED["sync"])
    assert (cost.k3, cost.k4) == (cal["span_k3"], cal["span_k4"])
    assert 0 < cost.proximal_share == cal["train_forward_share"] < 1
    for k in ("k3", "k4", "proximal_share", "train_accumulate_s", "train_step_s", "controller_s_per_trajectory"):
        assert "sync run" in cost.sources[k], k


def test_the_simulated_sync_loop_is_the_recorded_one_within_the_tolerance():
    """The calibration run itself: the simulated sync loop against the one it was measured on."""
    (r, *_) = validate.rows(RECORDED)
    assert abs(r.sim_sync_s / RECORDED["sync"]["loop_s"] - 1.0) <= validate.TOLERANCE


def test_the_recorder_gives_each_pair_two_free_ports_not_the_bench_default():
    """bench/policies.py's default port (29700) may be held by another bench on the machine; a pair's two runs
    rendezvous on port and port + 10."""
    import socket
    port = validate.free_port()
    for p in (port, port + 10):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    assert validate.bench_argv(validate.ROOT, "areal", port)[-2:] == ["--port", str(port)]

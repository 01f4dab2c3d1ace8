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
# our own run", has the table and the causes). Recorded on an idle machine (1-minute load 1.1-3.9).
OVERLAP = ("model: simulated engines, trainer and controller never slow each other; on the real ranks the presets that "
           "overlap generation with training run slower than sync on 2 cores (the controller runs in rank 0's process "
           "beside the trainer; sync's run never overlaps the two, so no such term can be calibrated from it)")
CALL = ("model: sync's calls all take 8 optimizer steps, so its fit cannot tell a cost per call from one per step and "
        "charges the fixed time a call per step; a preset with other calls per step (slime's 8 a round, the stream "
        "trainers' calls that only accumulate) pays a per-call cost the simulation does not charge")
LOADED = ("recorded later than the others, at 1-minute load 14-18 on 2 cores (its pair's sync loop 8.4-11.9 s against "
          "the idle recording's 3.5 s), so the load moves its measured speedup by more than the tolerance")
APRIL = ("recorded later, at 1-minute load 10-13 on 2 cores (its pair's sync loop 16.3 s against the idle "
         "recording's 3.5 s); the simulation, calibrated on the idle run, charges APRIL's twice as many sequences per "
         "decode step and its 886 interrupts at that run's costs; which of the load and those costs moves the "
         "measured ratio is not established")
KNOWN_MISSES: dict[str, str] = {   # error: simulated, measured
    "april": f"-38.0%: simulated 0.92x, measured 1.48x. {APRIL}",
    "areal": f"+64.3%: simulated 1.33x, measured 0.81x. {OVERLAP}",
    "fgd_tailbatch": f"+31.4%: simulated 1.27x, measured 0.97x. {OVERLAP}",
    "laminar": f"+65.7%: simulated 1.34x, measured 0.81x. {OVERLAP}",
    "one_step": f"+43.3%: simulated 1.33x, measured 0.93x. {OVERLAP}",
    "pacing": f"+51.5%: simulated 1.33x, measured 0.88x. {OVERLAP}; {LOADED}",
    "partial_rollout": f"+19.6%: simulated 1.33x, measured 1.11x. {OVERLAP}",
    "rolloutpipe": f"+42.5%: simulated 1.29x, measured 0.91x. {OVERLAP}",
    "rollpacker": f"-21.1%: simulated 1.76x, measured 2.23x. {CALL}",
    "slime": f"+15.8%: simulated 1.00x, measured 0.86x. {CALL}",
    "staleflow": f"+60.3%: simulated 1.32x, measured 0.82x. {OVERLAP}",
    "staleflow_vanilla": f"+50.8%: simulated 1.30x, measured 0.86x. {OVERLAP}",
    "stream_generation": f"+22.9%: simulated 3.66x, measured 2.98x. {CALL}",
    "streamrl": f"+39.7%: simulated 2.63x, measured 1.88x. {CALL}",
    "streamrl_async": f"+39.6%: simulated 3.83x, measured 2.75x. {CALL}",
    "verl_async": f"+49.9%: simulated 1.32x, measured 0.88x. {OVERLAP}",
    "windowed_fifo": f"+91.8%: simulated 1.32x, measured 0.69x. {OVERLAP}; {LOADED}",
}


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


def test_the_profile_charges_the_trainer_as_fitted_on_sync_calls_with_their_optimizer_steps():
    """sync.json's train_fit (per token, per optimizer step, per call) is the simulated trainer's cost, and each
    preset's calls take the optimizer steps bench/policies.py gives it (sync: P / U minibatches a call)."""
    cal = RECORDED["sync"]["calibration"]
    cost = validate.profile_from(RECORDED["sync"])
    assert (cost.train_s_per_token, cost.train_step_s, cost.train_overhead_s) == (
        cal["train_fit_s_per_token_one_rank"], cal["train_step_s"], cal["train_call_s"])
    assert cost.train_step_s > 0
    setting = RECORDED["sync"]["setting"]
    assert validate.sim_setting("sync", setting)[2] == setting["prompts"] // setting["batch_groups"]
    assert validate.sim_setting("stream_generation", setting)[2] == 1

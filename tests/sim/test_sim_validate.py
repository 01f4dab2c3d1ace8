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
# our own run", has the table and the causes).
OVERLAP = ("model: simulated engines, trainer and controller never slow each other; on the real ranks training slows "
           "while generation runs (the controller runs in rank 0's process beside the trainer; sync's run never "
           "overlaps the two, so no such term can be calibrated from it); its time per optimizer step was")
LOAD = "measurement: recorded at 1-minute load 12-23 on 2 cores (the pairs' identical sync runs took 6.7-27.7 s)"
CALL = ("model: sync's calls all take 8 optimizer steps, so its fit cannot tell a cost per call from one per step and "
        "charges the fixed 0.29 s a call per step; this preset's calls that only accumulate (no step) then cost "
        "almost nothing, while its own run fits")
KNOWN_MISSES: dict[str, str] = {   # error: simulated, measured here; measured in a second full recording (and pair)
    "areal": f"+39%: 1.48x, 1.07x; 0.86x. {OVERLAP} 1.57x sync's; {LOAD}",
    "fgd_tailbatch": f"+54%: 1.39x, 0.90x; 2.34x. {LOAD}; {OVERLAP} 1.37x sync's",
    "laminar": f"+114%: 1.51x, 0.71x; 1.14x, 0.77x. {LOAD}; {OVERLAP} 1.97x sync's",
    "one_step": f"+25%: 1.48x, 1.18x; 1.30x, 0.95x. {LOAD}; {OVERLAP} 1.12x sync's",
    "partial_rollout": f"+164%: 1.48x, 0.56x; 1.86x, 1.08x. {LOAD}; {OVERLAP} 2.43x sync's",
    "rolloutpipe": f"+24%: 1.43x, 1.15x; 1.03x. {OVERLAP} 1.08x sync's",
    "rollpacker": f"+18%: 1.40x, 1.18x; 2.12x. {LOAD}; {CALL} 0.20 s a call (30 calls, 12 steps)",
    "staleflow": f"+32%: 1.45x, 1.10x; 1.97x. {LOAD}; {OVERLAP} 1.21x sync's",
    "staleflow_vanilla": f"+50%: 1.42x, 0.95x; 1.05x. {OVERLAP} 1.39x sync's",
    "streamrl_async": f"+52%: 2.95x, 1.94x; 2.83x. {CALL} 0.10 s a call and 0.04 s a step (30 calls, 12 steps)",
    "verl_async": f"+38%: 1.46x, 1.05x; 0.80x. {OVERLAP} 1.28x sync's; {LOAD}",
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

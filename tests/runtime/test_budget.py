"""A run's budget (runtime/budget.py): `train.samples` honoured by every preset, the start-up line that says what
`train.steps` means under the chosen preset, and the error when both keys are set."""
from __future__ import annotations

import json
import math

import pytest

import sched
import train
from config import ConfigError, load_config, save_config
from runtime.budget import resolve
from sched.controller import Controller, PromptItem
from sched.events import EventLog
from sim.backend import SimBackend
from sim.cost import CostModel, RewardLatency, RewardTask
from sim.tokens import RunList
from sim.workload import TraceWorkload
from tests.support.launch import torchrun

PRESETS = sorted(p.stem for p in sched.PRESET_DIR.glob("*.toml"))


def budget(*args: str, path: str | None = "configs/tiny.toml"):
    cfg = load_config(path, list(args))
    return cfg, resolve(cfg, sched.load_preset(cfg.sched.preset, cfg.sched.overrides(), cfg.sources))


# ------------------------------------------------------------------------------------------------ start-up line
def test_the_line_states_the_samples_behind_train_steps_under_sync_and_rolloutpipe():
    """tiny.toml: 150 steps, 32 prompts x 8. sync steps once per round (32 groups), rolloutpipe every U = 2 groups."""
    _, b = budget()
    assert b.line == "budget: train.steps = 150 optimizer steps of 32 groups x 8 = 38,400 samples under sync"
    assert (b.steps, b.samples) == (150, None)
    _, b = budget("--sched.preset=rolloutpipe")
    assert "150 optimizer steps of 2 groups x 8 = 2,400 samples under rolloutpipe" in b.line
    assert "(sync's 150 steps: 38,400; " in b.line
    # the numbers come from the preset's mechanisms: a larger U, or a smaller round, changes them
    _, b = budget("--sched.preset=rolloutpipe", "--sched.update.groups=4", "--sched.handoff.groups=4",
                  "--rollout.prompts_per_step=16", "--train.steps=10")
    assert "10 optimizer steps of 4 groups x 8 = 320 samples" in b.line and "(sync's 10 steps: 1,280; " in b.line


def test_a_samples_budget_becomes_each_presets_own_step_count():
    _, b = budget("--sched.preset=rolloutpipe", "--train.samples=38400")
    assert (b.steps, b.samples) == (2400, 38400)
    assert b.line.startswith("budget: train.samples = 38,400 samples = 2,400 optimizer steps of 2 groups x 8 ")
    assert b.line.endswith("(sync: 150 steps of 32 groups x 8)")
    _, b = budget("--sched.preset=streamrl", "--train.samples=1000")   # one step per round: rounded up to it
    assert (b.steps, b.samples) == (4, 1000) and "(rounded up to whole steps: 1,024)" in b.line


def test_check_prints_the_budget(capsys):
    from runtime.preflight import preflight
    assert preflight("configs/tiny.toml", ["--sched.preset=rolloutpipe", "--train.samples=2560"]) == 0
    assert "budget    train.samples = 2,560 samples = 160 optimizer steps of 2 groups x 8 under rolloutpipe " \
           "(sync: 10 steps of 32 groups x 8)" in capsys.readouterr().out


def test_both_keys_in_one_place_is_a_one_line_error(capsys):
    assert train.main(["--config", "configs/tiny.toml", "--train.steps=10", "--train.samples=2560"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("config error: train.steps = 10 and train.samples = 2560 are both set (command line)")
    with pytest.raises(ConfigError, match="both set"):
        budget("--train.steps=10", "--train.samples=2560", path=None)


def test_the_command_line_replaces_the_files_key_and_the_saved_config_reloads(tmp_path):
    cfg, b = budget("--sched.preset=rolloutpipe", "--train.samples=512")   # tiny.toml sets train.steps = 150
    assert (b.steps, b.samples) == (32, 512)
    b.apply(cfg)
    path = save_config(cfg, tmp_path)           # both keys in one file, agreeing: the run's resolved config
    again, b2 = budget(path=str(path))
    assert (b2.steps, b2.samples) == (32, 512) and again.train.samples == 512
    cfg, b = budget("--train.steps=7", path=str(path))  # steps on the command line wins
    b.apply(cfg)
    assert (b.steps, b.samples, cfg.train.samples) == (7, None, 0)


# ------------------------------------------------------------------------------------ honoured by every preset
def cost() -> CostModel:
    return CostModel(name="test", k1=1e-6, k2=1e-3, k3=1e-4, k4=1e-3, prefill_s_per_token=1e-5,
                     kv_capacity_tokens=16 * 1000, train_s_per_token=1e-5, publish_s=0.05, load_s=0.01,
                     reward=RewardLatency((RewardTask("math", 1.0, 1e-4, 0.1, 1.0),)), block_size=16, max_num_seqs=64)


def drive(preset: str, samples: int, prompts: int = 4, group_size: int = 4) -> tuple[Controller, list]:
    """The controller on the simulator's backend (the events a real engine sends) with a budget in samples."""
    w = TraceWorkload("t", tuple((16, (200, 30, 30, 30)) for _ in range(4)))
    backend = SimBackend(cost(), w, 2, 1, seed=0)
    counter = iter(range(10**6))
    source = lambda n: [PromptItem(i % 4, RunList.of(1, 16), None) for i in (next(counter) for _ in range(n))]
    calls: list = []
    train_ = backend.train
    backend.train = lambda call, groups: (calls.append((call, groups)), train_(call, groups))
    ctl = Controller(sched.load_preset(preset), source, group_size=group_size, prompts_per_step=prompts,
                     total_steps=10**6, log=EventLog(), total_samples=samples)
    ctl.run(backend)
    return ctl, calls


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_trains_the_samples_budget_and_ends_on_a_step(preset):
    """Three rounds' worth (48 samples) is 3 steps for sync, 6 for rolloutpipe (U = 2 groups), 3 for the stream
    update: each trains exactly 48; a budget off the step grid (40) is rounded up to the preset's own step, which
    Preset.groups_per_step (the start-up line's number) must predict."""
    P, G = 4, 4
    per_step = sched.load_preset(preset).groups_per_step(P) * G
    for want in (48, 40):
        ctl, calls = drive(preset, want, P, G)
        trained = sum(len(g.trajectories) for _, gs in calls for g in gs)
        assert trained == math.ceil(want / per_step) * per_step, (want, trained, per_step)
        assert calls[-1][0].step and ctl.v.trainer.groups_since_step == 0 and not ctl.v.trainer.busy
        assert ctl.v.trainer.samples_consumed == trained
        assert ctl.v.trainer.steps_done == trained // per_step
    state = ctl.state_dict()                 # a resumed run goes on from the samples already trained
    fresh = Controller(sched.load_preset(preset), lambda n: [], group_size=G, prompts_per_step=P, total_steps=1,
                       total_samples=trained)
    fresh.load_state_dict(state)
    assert fresh.v.trainer.samples_consumed == trained and fresh.done


# ------------------------------------------------------------------------------------------------- real ranks
@pytest.mark.dist
@pytest.mark.slow
def test_sync_and_rolloutpipe_train_the_same_samples_on_real_ranks(tmp_path):
    """One key switches the preset; `train.samples` keeps the runs comparable: 2 rounds of 8 prompts x 8 are 2
    steps of sync and 8 of rolloutpipe, 128 samples each; the start-up line says so."""
    out = {}
    for preset, steps in (("sync", 2), ("rolloutpipe", 8)):
        run = tmp_path / preset
        proc = torchrun(2, f"--log.dir={run}", f"--sched.preset={preset}", "--train.samples=128",
                        "--rollout.prompts_per_step=8", "--checkpoint.export_hf=false")
        out[preset] = proc.stdout
        assert [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()] == \
            list(range(1, steps + 1))
        assert json.loads((run / "summary.json").read_text())["samples_trained"] == 128
    assert "budget: train.samples = 128 samples = 2 optimizer steps of 8 groups x 8 under sync" in out["sync"]
    assert "= 8 optimizer steps of 2 groups x 8 under rolloutpipe (sync: 2 steps" in out["rolloutpipe"]

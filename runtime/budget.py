"""A run's budget, and what it means under the chosen preset.

`train.steps` counts optimizer steps, and a step's size is the preset's own: sync steps once per round of
`prompts_per_step` groups, an every-U preset (rolloutpipe, slime) every U groups, so the same `train.steps` trains
P / U times fewer samples there. `train.samples` is a budget in trained samples (a sample: one trained response)
that every preset honours: the controller stops once that many samples are handed to the trainer and the optimizer
step over them is taken (sched/controller.py `Controller.spent`), so two presets switched by one key train on the
same number of samples (rounded up to the preset's step: a stream-update preset finishes its round).

`resolve` picks the budget (the two keys are exclusive: both set in one place is an error; one on the command line
replaces the other from the file) and writes the start-up line train.py always prints, in the preset's optimizer
batch (sched.base.Preset.groups_per_step) beside sync's:

    budget: train.steps = 150 optimizer steps of 2 groups x 8 = 2,400 samples under rolloutpipe (sync's 150 steps:
    38,400; equal samples: train.samples)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sched
from config import CMDLINE, Config, ConfigError
from sched.base import Preset

REFERENCE = "sync"   # the preset every other one is compared against


@dataclass(frozen=True)
class Budget:
    """The run's budget: `steps` optimizer steps, or `samples` trained samples with `steps` their worth in the
    preset's optimizer batch (what the learning-rate schedule and the progress bar plan for)."""
    steps: int
    samples: int | None
    line: str

    def apply(self, cfg: Config) -> None:
        """Write the budget into the config (every rank: the trainer's schedule reads `train.steps`), so that the
        run's saved config.toml holds one consistent pair."""
        cfg.train.steps, cfg.train.samples = self.steps, self.samples or 0


def step_groups(preset: Preset, prompts_per_step: int) -> tuple[int, bool]:
    """Groups per optimizer step under `preset`, and whether its mechanisms fix that number (if not: a round's)."""
    g = preset.groups_per_step(prompts_per_step)
    return (g, True) if g else (prompts_per_step, False)


def resolve(cfg: Config, preset: Preset) -> Budget:
    """The run's budget under `preset` and its start-up line. Raises ConfigError when both keys are set in one
    place with different meanings."""
    t, P, G = cfg.train, cfg.rollout.prompts_per_step, cfg.rollout.group_size
    g, known = step_groups(preset, P)
    ref, _ = step_groups(sched.load_preset(REFERENCE), P)
    per_step, ref_per_step = g * G, ref * G
    worth = math.ceil(t.samples / per_step) if t.samples else 0
    use_samples = t.samples > 0 and samples_win(cfg, worth)
    name = cfg.sched.preset + (" (with its mechanisms overridden)" if any(cfg.sched.overrides().values()) else "")
    k = t.ppo_epochs * t.minibatches
    unit = "optimizer steps" if k == 1 else "train steps"
    note = "" if k == 1 else f"; a train step is {k} optimizer steps (train.ppo_epochs x train.minibatches)"
    batch = f"{g:,} groups x {G}" + ("" if known else f" (a round: {name}'s batch is not fixed by its config)")
    if use_samples:
        steps, total = worth, worth * per_step
        rounded = "" if total == t.samples else f" (rounded up to whole steps: {total:,})"
        line = f"budget: train.samples = {t.samples:,} samples = {steps:,} {unit} of {batch}{rounded} under {name}"
        if per_step != ref_per_step:
            line += f" ({REFERENCE}: {math.ceil(t.samples / ref_per_step):,} steps of {ref:,} groups x {G})"
        return Budget(steps, t.samples, line + note)
    line = f"budget: train.steps = {t.steps:,} {unit} of {batch} = {t.steps * per_step:,} samples under {name}"
    if per_step != ref_per_step:
        line += f" ({REFERENCE}'s {t.steps:,} steps: {t.steps * ref_per_step:,}; equal samples: train.samples)"
    line += note
    return Budget(t.steps, None, line)


def samples_win(cfg: Config, worth: int) -> bool:
    """Whether a nonzero `train.samples` is the budget: `train.steps` left at its default, or set in a file the
    command line's `train.samples` overrides. Both in one place is an error, unless a file gives them agreeing (a
    run's resolved config.toml writes both, `steps` as the samples' worth)."""
    t = cfg.train
    src_steps, src_samples = cfg.sources.get("train.steps"), cfg.sources.get("train.samples")
    if src_steps is None:
        return True
    if src_steps == src_samples:
        if t.steps == worth and src_steps != CMDLINE:
            return True
        raise ConfigError(f"train.steps = {t.steps} and train.samples = {t.samples} are both set ({src_steps}): a "
                          f"run's budget is one of them (optimizer steps, or trained samples for every preset)")
    return src_samples == CMDLINE

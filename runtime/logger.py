"""The leader's run log: events.jsonl (every event), metrics.jsonl (one line per train step), a console progress
bar (from the run's first round, at the step a resumed run continues from; closed at the last step, so the closing
phases' lines of runtime/progress.py follow it), start-up lines as the engines first hold weights and the first round
starts, and wandb when `log.wandb` is set (offline mode when no API key is configured, or as WANDB_MODE says): the
run config attached, every metrics row logged at its step, the timeline image at the end.

Per-step metrics = the trainer's (loss, KL, entropy, clip fractions, grad norm, lr, reward mean, accuracy,
response lengths) + what the event log says about the step's window (tokens/s, trainer waiting ratio, engine idle
ratio, staleness, weight-sync time), computed by sched/metrics.py, the same code the simulator reports with.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from runtime.progress import phase
from sched.events import Event, EventLog
from sched.metrics import summarize

WINDOW_KEYS = ("tokens_per_s", "samples_per_s", "trainer_wait_ratio", "engine_idle_ratio", "staleness_max")
LOGS = ("events.jsonl", "metrics.jsonl")   # the run directory's logs, cut back to a checkpoint on resume


class MetricsLogger(EventLog):
    def __init__(self, cfg: Any, run_dir: str | Path, num_engines: int | None = None):
        super().__init__(Path(run_dir) / "events.jsonl", keep=False, compact=cfg.log.request_events == "compact")
        self.run_dir = Path(run_dir)
        self.metrics_f = open(self.run_dir / "metrics.jsonl", "a")
        self.num_engines = num_engines
        self.every = cfg.log.every
        self.window: list[Event] = []
        self.step_end: dict[int, float] = {}
        self.last_sync_s: float | None = None
        self.history: list[dict[str, Any]] = []
        self.bar = None
        self.show_bar, self.total_steps = cfg.log.progress, cfg.train.steps
        self.start_step = 0              # the step a resumed run continues from (`resumed`)
        self.loaded: set[int] = set()    # engines that have loaded weights (the start-up line once all have)
        self.started = False             # the first round has started
        self.wandb = None
        if cfg.log.wandb:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("log.wandb = true but wandb is not installed: pip install -e '.[wandb]'")
            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project=cfg.log.wandb_project, entity=cfg.log.wandb_entity or None,
                                    name=self.run_dir.name, dir=str(self.run_dir), mode=mode,
                                    config={**dataclasses.asdict(cfg), "run_dir": str(self.run_dir)})

    def resumed(self, step: int) -> None:
        """This attempt continues a run from its checkpoint at `step`: the bar starts there."""
        self.start_step = step

    def open_bar(self) -> None:
        if self.show_bar and self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=self.total_steps, initial=self.start_step, desc="steps", dynamic_ncols=True,
                            leave=True)

    def end_bar(self) -> None:
        """The steps are over (the last one, or a samples budget spent first): the bar closes, so that the closing
        phases' lines follow it rather than overwrite it."""
        if self.bar is not None:
            self.bar.close()

    def write(self, ev: Event) -> None:
        super().write(ev)
        self.window.append(ev)
        if ev.kind == "weights_loaded" and ev.engine >= 0 and len(self.loaded) < (self.num_engines or 1):
            self.loaded.add(ev.engine)
            if len(self.loaded) == (self.num_engines or 1):
                phase(f"engines ready: {len(self.loaded)} with weights", rank=0, timed=True)
        if ev.kind == "round_started" and not self.started:
            self.started = True
            phase("first round started" + (f" (resumed at step {self.start_step})" if self.start_step else ""),
                  rank=0)
            self.open_bar()
        if ev.kind == "version_published" and ev.version in self.step_end:
            self.last_sync_s = ev.t - self.step_end[ev.version]
        if ev.kind == "train_step_done" and ev.data.get("stepped", True):
            self.step_end[ev.version] = ev.t
            self.on_step(ev)

    def on_step(self, ev: Event) -> None:
        summary = summarize(self.window, self.num_engines)
        row: dict[str, Any] = {"step": ev.version, "time_s": round(ev.t, 3)}
        row.update({k: v for k, v in ev.data.items() if k != "stepped"})
        row.update({k: summary[k] for k in WINDOW_KEYS if k in summary})
        if self.last_sync_s is not None:
            row["weight_sync_s"] = self.last_sync_s
        self.window = [e for e in self.window if e.kind in ("group_materialized",)][-10_000:]
        self.history.append(row)
        if ev.version % self.every == 0:
            self.metrics_f.write(json.dumps(row) + "\n")
            self.metrics_f.flush()
            self.flush()
            if self.wandb is not None:
                self.wandb.log(row, step=ev.version)
        self.open_bar()
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{row.get('reward_mean', 0):.3f}", acc=f"{row.get('accuracy', 0):.2f}",
                                 loss=f"{row.get('loss', 0):.3f}", refresh=False)
            self.bar.update(max(0, ev.version - self.bar.n))
            if self.bar.n >= self.total_steps:
                self.end_bar()

    def marks(self) -> dict[str, int]:
        """Byte lengths of the run's logs as of now (flushed first): where a checkpoint taken now cuts them back."""
        out = {}
        self.flush()            # the per-request events held back for a compact line, too
        for name, f in zip(LOGS, (self._f, self.metrics_f)):
            if f is not None and not f.closed:
                f.flush()
                out[name] = f.tell()
        return out

    def close(self) -> None:
        super().close()
        self.metrics_f.close()
        self.end_bar()
        if self.wandb is not None:
            self.log_timeline()
            self.wandb.finish()

    def log_timeline(self) -> None:
        """timeline.png (sched/timeline.py, from the event log) as a wandb image at the last step."""
        import wandb

        from sched.events import read_events
        from sched.timeline import draw
        path = self.run_dir / "timeline.png"
        draw(list(read_events(self.run_dir / "events.jsonl")), path, self.run_dir.name)
        step = self.history[-1]["step"] if self.history else None
        self.wandb.log({"timeline": wandb.Image(str(path))}, step=step)

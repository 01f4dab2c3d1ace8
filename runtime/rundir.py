"""Where a run lives and how it resumes: the run directory, the checkpoint an attempt starts from, what a checkpoint
holds beyond the trainer's state, the logs cut back to it, and the end-of-run summary.

A run directory (`log.dir`, default runs/<config>-<timestamp>) holds config.toml, events.jsonl, metrics.jsonl,
summary.json, timeline.png, curves.png, checkpoints/step_N/ (torch.distributed.checkpoint; `checkpoint.dir` may move
them) and hf/. A resumed (or torchrun-restarted) run continues the checkpoint's clock and cuts its logs back to
where the checkpoint left them, the dead attempt's later lines going to *.discarded.jsonl, so the logs read as one
run.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from config import Config, resolve_run_dir, save_config
from runtime.build import RunParts
from runtime.curves import draw_curves, read_rows
from runtime.logger import LOGS, MetricsLogger
from runtime.preempt import Preemption, safe_point_hook
from runtime.progress import phase
from sched.controller import Controller
from sched.events import Event, read_events
from sched.metrics import summarize
from sched.timeline import draw
from trainer import checkpoint


def restart_count() -> int:
    """How many times torchrun has restarted this job (0: the first attempt; `--max-restarts` allows more)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def checkpoint_dir(cfg: Config, run_dir: str | Path | None = None) -> Path:
    """`checkpoint.dir`, or RUN_DIR/checkpoints."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir or cfg.log.dir) / "checkpoints"


def resume_path(cfg: Config) -> Path | None:
    """The checkpoint this attempt starts from, or None for a fresh start: `checkpoint.resume = "latest"` starts
    afresh when the run directory has no complete checkpoint yet; a named checkpoint that cannot be resumed from
    is an error (FileNotFoundError). Every rank calls it and gets the same answer. A job that torchrun restarted
    (`--max-restarts`) resumes from the newest complete checkpoint of its run directory on its own, when it has one
    (the run directory must be stable: set log.dir or checkpoint.dir)."""
    if not cfg.checkpoint.resume:
        if restart_count() > 0 and (cfg.log.dir or cfg.checkpoint.dir):
            return checkpoint.latest(checkpoint_dir(cfg))
        return None
    if cfg.checkpoint.resume == "latest":   # none yet (a first run, or one stopped before its first): afresh
        if not cfg.log.dir and not cfg.checkpoint.dir:
            raise ValueError("checkpoint.resume = 'latest' needs log.dir (the run directory to resume)")
        return checkpoint.latest(checkpoint_dir(cfg))
    path = Path(cfg.checkpoint.resume)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint.resume = {cfg.checkpoint.resume!r} is not a directory")
    if (bad := checkpoint.problem(path)) is not None:
        raise FileNotFoundError(f"checkpoint.resume = {cfg.checkpoint.resume!r} cannot be resumed from: {bad}")
    return path


def skipped_checkpoints(cfg: Config, path: Path | None) -> list[str]:
    """A warning for each checkpoint newer than `path` (the one this attempt resumes from) that cannot be resumed
    from: a write interrupted by a crash, a marker or manifest that does not match the files on disk."""
    if cfg.checkpoint.resume not in ("", "latest"):
        return []
    out = []
    for step, p, bad in reversed(checkpoint.scan(checkpoint_dir(cfg))):
        if p == path:
            break
        if bad is not None:
            out.append(f"warning: checkpoint {p} cannot be resumed from: {bad}; "
                       + (f"falling back to {path}" if path is not None else "no earlier complete checkpoint"))
    return out


def prepare_run_dir(cfg: Config) -> tuple[str, float]:
    """Leader only, before any log is opened: the run directory (made, with the resolved config.toml) and the run's
    clock origin t0. A resumed run (or a restarted one) cuts its logs back to where its checkpoint left them and
    continues the checkpoint's clock."""
    run_dir = Path(resolve_run_dir(cfg))
    run_dir.mkdir(parents=True, exist_ok=True)
    for empty in run_dir.glob("fatal-rank*.txt"):  # no fatal signal in the attempt that left it (runtime/watchdog.py)
        if empty.stat().st_size == 0:
            empty.unlink()
    save_config(cfg, run_dir)
    now = time.time()
    path = resume_path(cfg)
    if path is None and restart_count() == 0 and cfg.checkpoint.resume != "latest":
        return str(run_dir), now
    for line in skipped_checkpoints(cfg, path):
        print(line, file=sys.stderr, flush=True)
    marks = checkpoint.read_extra(path).get("extra", {}).get("log", {}) if path is not None else {"t": 0.0}
    for name in LOGS:
        rewind_log(run_dir / name, int(marks.get(name, 0)))
    if restart_count() > 0 or path is not None:
        print(f"restart {restart_count()}: " + (f"resuming from {path}" if path is not None else
              "no complete checkpoint yet, starting afresh"), file=sys.stderr, flush=True)
    else:   # the logs of an earlier attempt that left no checkpoint went to *.discarded.jsonl above
        print(f"checkpoint.resume = 'latest': no complete checkpoint in {checkpoint_dir(cfg, run_dir)} yet, "
              "starting afresh", file=sys.stderr, flush=True)
    return str(run_dir), now - float(marks.get("t", 0.0))


def rewind_log(path: Path, size: int) -> None:
    """Truncate `path` to `size` bytes, appending the cut tail to NAME.discarded.jsonl."""
    if not path.is_file() or path.stat().st_size <= size:
        return
    with open(path, "rb") as f:
        f.seek(size)
        tail = f.read()
    with open(path.with_suffix(".discarded.jsonl"), "ab") as out:
        out.write(tail)
    with open(path, "r+b") as f:
        f.truncate(size)


# ---------------------------------------------------------------------------------------- checkpoint contents
def leader_state(controller: Controller, parts: RunParts, log: MetricsLogger) -> dict[str, Any]:
    """What a checkpoint holds beyond the trainer's state: the controller's counters, views (trajectories finished
    and in flight, sched/resume.py) and policy state, the data position, the RNG, and how far the run's logs reached
    with the controller's clock (a resumed run cuts them back there)."""
    return {"controller": controller.state_dict(), "data": parts.source.state_dict(), "rng": torch.get_rng_state(),
            "log": {"t": controller.v.now, **log.marks()}}


def restore(controller: Controller, parts: RunParts, extra: dict[str, Any]) -> None:
    controller.load_state_dict(extra["controller"])
    parts.source.load_state_dict(extra["data"])
    torch.set_rng_state(extra["rng"])


def periodic_checkpoints(cfg: Config, controller: Controller, save: Callable[[], None],
                         preemption: Preemption | None = None) -> Callable[[Event], None]:
    """The controller's after-event hook: every `checkpoint.every` published versions, `save()` at the first moment
    the trainer holds no work (nothing training, no gradients accumulated); trajectories in flight go into the
    controller's state (sched/resume.py). The final checkpoint is the caller's. A resumed run does not save the
    version it resumed from again (its first publication is that version's): that checkpoint is on disk. Under a
    preemption request (runtime/preempt.py) the first such moment saves and raises Preempted."""
    due = [False]
    start = controller.v.trainer.version

    def safe() -> bool:
        t = controller.v.trainer
        return not t.busy and t.groups_since_step == 0 and not controller.done

    saved = [False]
    preempt_check = safe_point_hook(preemption, safe, save, saved_now=lambda: saved[0])

    def after_event(ev: Event) -> None:
        every = cfg.checkpoint.every
        if ev.kind == "version_published" and every and ev.version % every == 0 and \
                start < ev.version < cfg.train.steps:
            due[0] = True
        saved[0] = False
        if due[0] and safe():
            due[0] = False
            save()
            saved[0] = True
        preempt_check()
    return after_event


# ------------------------------------------------------------------------------------------------ run summary
def fault_counts(events: list[Event]) -> dict[str, int]:
    """Isolated faults the run went on through, from its event log: scores whose reward function failed (raised
    or timed out; they scored 0) and samples dropped because their logits went non-finite."""
    return {"reward_failed": sum(1 for e in events if e.kind == "reward_scored" and e.data.get("failed")),
            "sample_errors": sum(1 for e in events if e.kind == "trajectory_aborted" and e.data.get("error"))}


def run_rows(run_dir: str | Path, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every step's metrics row of the whole run: this attempt's `history`, after the rows of metrics.jsonl from
    before it (an attempt resumed from a checkpoint at step N continues a file cut back to its rows <= N; those are
    every `log.every`-th step's)."""
    first = history[0]["step"] if history else float("inf")
    path = Path(run_dir) / "metrics.jsonl"
    earlier = []
    if first > 1 and path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if isinstance(row.get("step"), int) and row["step"] < first:
                earlier.append(row)
    return earlier + history


def finish_run(run_dir: str, log: MetricsLogger, parts: RunParts, plots: bool = True) -> None:
    """summary.json and timeline.png, both from the event log (without the per-request admissions, which neither
    reads), for the rewards every step's row of the run (earlier attempts' included), and curves.png from
    metrics.jsonl. Without `plots` (`log.plots = false`), summary.json alone."""
    phase("writing summary.json, timeline.png and curves.png" if plots else "writing summary.json")
    events = list(read_events(Path(run_dir) / "events.jsonl", skip=("request_admitted",)))
    summary = summarize(events, log.num_engines)
    hist = run_rows(run_dir, log.history)
    if hist:
        k = max(1, len(hist) // 4)
        summary["reward_first"] = sum(h.get("reward_mean", 0) for h in hist[:k]) / k
        summary["reward_last"] = sum(h.get("reward_mean", 0) for h in hist[-k:]) / k
    summary.update(fault_counts(events))
    summary["samples_trained"] = int(sum(e.data.get("samples", 0) for e in events if e.kind == "train_step_done"))
    summary["skipped_prompts"] = parts.skipped_prompts
    (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if plots:
        draw(events, Path(run_dir) / "timeline.png", Path(run_dir).name, summary)
        rows = read_rows(Path(run_dir) / "metrics.jsonl")   # the file: a resumed run's every step, not this attempt's
        if rows:
            draw_curves(rows, Path(run_dir) / "curves.png", Path(run_dir).name)
    print(f"run directory: {run_dir}  reward {summary.get('reward_first', 0):.3f} -> "
          f"{summary.get('reward_last', 0):.3f}  ({summary['makespan_s']:.1f}s)")

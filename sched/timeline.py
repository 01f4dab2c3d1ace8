"""Draw who waited for whom: one lane per engine (decode busy / idle, weight loads) and one for the trainer
(train calls, weight publication), from an event log. Works on a real run's or a simulated run's events.jsonl.

A run of at most WHOLE_MAX_STEPS steps is drawn whole, every span. A longer one would be a barcode, so it is drawn as
the whole run at a glance (each lane's busy fraction per time bin) above a few steps in detail: the first and the last
DETAIL_STEPS, or the window `steps` names.

    python -m sched.timeline RUN_DIR                  # writes RUN_DIR/timeline.png
    python -m sched.timeline RUN_DIR --steps 10:20    # the overview, and steps 10 to 20 in detail
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sched.events import Event, read_events
from sched.metrics import engine_spans, summarize, trainer_spans

WHOLE_MAX_STEPS = 24   # a run of more steps is drawn as an overview plus details
DETAIL_STEPS = 3       # steps in each detail panel (the first and the last ones)
OVERVIEW_BINS = 200    # time bins of the overview, at most

BUSY, TRAIN, SYNC, IDLE, LOAD = "#4c78a8", "#f58518", "#e45756", "#eeeeee", "#e45756"


def parse_steps(text: str) -> tuple[int, int]:
    """'A:B' -> (A, B), the steps A to B inclusive; A or B may be left out (from the first, to the last step)."""
    a, sep, b = text.partition(":")
    try:
        lo = int(a) if a.strip() else 0
        hi = int(b) if b.strip() else 10**9
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected A:B, two step numbers (e.g. 10:20)") from None
    if not sep or lo > hi or lo < 0:
        raise ValueError(f"--steps {text!r}: expected A:B with 0 <= A <= B (e.g. 10:20)")
    return lo, hi


def step_ends(events: list[Event]) -> list[tuple[int, float]]:
    """(version, time) of every optimizer step, in time order."""
    return sorted(((e.version, e.t) for e in events if e.kind == "train_step_done" and e.data.get("stepped", True)),
                  key=lambda p: p[1])


def _lanes(ax: Any, events: list[Event], t0: float, t_end: float, n_eng: int) -> None:
    """Every span of the run on `ax` (x: seconds since t0): engines' decoding and weight loads, the trainer's
    calls and weight publications."""
    spans = engine_spans(events, t_end + t0)
    for i in range(n_eng):
        ax.broken_barh([(0, t_end)], (i - 0.35, 0.7), facecolors=IDLE)
        ax.broken_barh([(a - t0, b - a) for a, b in spans.get(i, [])], (i - 0.35, 0.7), facecolors=BUSY)
    for e in events:
        if e.kind == "weights_loaded":
            ax.plot([e.t - t0], [e.engine], marker="|", color=LOAD, markersize=14)
    tr = n_eng
    ax.broken_barh([(0, t_end)], (tr - 0.35, 0.7), facecolors=IDLE)
    ax.broken_barh([(a - t0, b - a) for a, b, _ in trainer_spans(events)], (tr - 0.35, 0.7), facecolors=TRAIN)
    done = {e.version: e.t for e in events if e.kind == "train_step_done" and e.data.get("stepped", True)}
    pubs = [(done[e.version] - t0, e.t - done[e.version]) for e in events
            if e.kind == "version_published" and e.version in done]
    ax.broken_barh(pubs, (tr - 0.35, 0.7), facecolors=SYNC)
    ax.set_yticks(range(n_eng + 1), [f"engine {i}" for i in range(n_eng)] + ["trainer"])


def busy_fractions(spans: list[tuple[float, float]], edges: list[float]) -> list[float]:
    """The fraction of each bin [edges[i], edges[i+1]) that `spans` (possibly overlapping: merged first) cover."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out, j = [], 0
    for lo, hi in zip(edges, edges[1:]):
        while j < len(merged) and merged[j][1] <= lo:
            j += 1
        cover, k = 0.0, j
        while k < len(merged) and merged[k][0] < hi:
            cover += max(0.0, min(hi, merged[k][1]) - max(lo, merged[k][0]))
            k += 1
        out.append(cover / (hi - lo) if hi > lo else 0.0)
    return out


def _overview(ax: Any, events: list[Event], t0: float, t_end: float, n_eng: int, n_steps: int
              ) -> list[list[float]]:
    """Each lane's busy fraction per time bin (engines: decoding, blue; trainer: train calls, orange) as an image,
    a bin about two steps wide (20 to OVERVIEW_BINS bins); the rows, engines then trainer."""
    n_bins = max(20, min(OVERVIEW_BINS, n_steps // 2))
    edges = [t_end * i / n_bins for i in range(n_bins + 1)]
    spans = engine_spans(events, t_end + t0)
    rows = [busy_fractions([(a - t0, b - t0) for a, b in spans.get(i, [])], edges) for i in range(n_eng)]
    rows.append(busy_fractions([(a - t0, b - t0) for a, b, _ in trainer_spans(events)], edges))
    rgb = [_rgb(BUSY)] * n_eng + [_rgb(TRAIN)]
    image = [[(*c, f) for f in row] for c, row in zip(rgb, rows)]
    ax.imshow(image, aspect="auto", interpolation="nearest", origin="lower", extent=(0.0, t_end, -0.5, n_eng + 0.5))
    ax.set_yticks(range(n_eng + 1), [f"engine {i}" for i in range(n_eng)] + ["trainer"])
    ax.set_xlim(0.0, t_end)
    return rows


def _rgb(hex_color: str) -> tuple[float, float, float]:
    return tuple(int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5))  # type: ignore[return-value]


def detail_windows(ends: list[tuple[int, float]], t0: float, steps: tuple[int, int] | None
                   ) -> list[tuple[int, int, float, float]]:
    """(first step, last step, start, end) of each detail panel, times since t0: a step's window runs from the
    previous step's end (the run's start for the first) to its own. `steps` (A, B): the steps A to B; else the first
    and the last DETAIL_STEPS."""
    if not ends:
        return []
    starts = [t0] + [t for _, t in ends[:-1]]
    idx = list(range(len(ends)))
    if steps is not None:
        groups = [[i for i in idx if steps[0] <= ends[i][0] <= steps[1]]]
    else:
        groups = [idx[:DETAIL_STEPS], idx[-DETAIL_STEPS:]]
    return [(ends[g[0]][0], ends[g[-1]][0], starts[g[0]] - t0, ends[g[-1]][1] - t0) for g in groups if g]


def timeline_figure(events: list[Event], title: str = "", summary: dict | None = None,
                    steps: tuple[int, int] | None = None) -> Any:
    """The timeline of `events` as a matplotlib Figure (closed: save or inspect it). `summary`: their `summarize`
    if the caller has it already; `steps` (A, B): the detail window (always drawn as overview plus detail)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not events:
        raise ValueError("no events to draw")
    t0 = min(e.t for e in events)
    t_end = max(e.t for e in events) - t0
    n_eng = max([e.engine for e in events if e.engine >= 0], default=-1) + 1
    m = summary if summary is not None else summarize(events, n_eng)
    head = (f"{title}  trainer wait {m.get('trainer_wait_ratio', 0):.0%}  "
            f"engine idle {m.get('engine_idle_ratio', 0):.0%}  "
            "(blue: decoding, orange: training, red: weight sync)").strip()
    ends = step_ends(events)
    lane_h = 0.5 * (n_eng + 1)
    if steps is None and len(ends) <= WHOLE_MAX_STEPS:
        fig, ax = plt.subplots(figsize=(12, 1.2 + lane_h))
        _lanes(ax, events, t0, t_end, n_eng)
        ax.set_xlabel("seconds")
        ax.set_title(head)
    else:
        windows = detail_windows(ends, t0, steps)
        if steps is not None and not windows:
            raise ValueError(f"--steps {steps[0]}:{steps[1]}: the run's steps are "
                             f"{ends[0][0]}-{ends[-1][0]}" if ends else "the run has no steps")
        fig = plt.figure(figsize=(12, 1.6 + lane_h * (1 + len(windows)) + 0.6 * len(windows)))
        grid = fig.add_gridspec(2, max(1, len(windows)), height_ratios=[1, 1])
        over = fig.add_subplot(grid[0, :])
        _overview(over, events, t0, t_end, n_eng, len(ends))
        for lo_step, hi_step, a, b in windows:
            over.axvspan(a, b, color=SYNC, alpha=0.15)
        over.set_xlabel("seconds")
        over.set_title(f"{head}\nwhole run, {len(ends)} steps: busy fraction per time bin "
                       "(stronger = busier; shaded: the steps below)", fontsize=9)
        for j, (lo_step, hi_step, a, b) in enumerate(windows):
            ax = fig.add_subplot(grid[1, j])
            _lanes(ax, events, t0, t_end, n_eng)
            ax.set_xlim(a, b)
            ax.set_xlabel("seconds")
            ax.set_title(f"steps {lo_step}-{hi_step}" if hi_step != lo_step else f"step {lo_step}", fontsize=9)
    fig.tight_layout()
    plt.close(fig)
    return fig


def draw(events: list[Event], out: str | Path, title: str = "", summary: dict | None = None,
         steps: tuple[int, int] | None = None) -> Path:
    """The timeline of `events` to the PNG `out` (timeline_figure)."""
    out = Path(out)
    timeline_figure(events, title, summary, steps).savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run directory holding events.jsonl")
    ap.add_argument("--out", help="PNG path (default RUN_DIR/timeline.png)")
    ap.add_argument("--steps", help="A:B, the steps to draw in detail, A to B inclusive (default: a run of more "
                    f"than {WHOLE_MAX_STEPS} steps shows its first and last {DETAIL_STEPS})")
    args = ap.parse_args(argv)
    log = Path(args.run_dir) / "events.jsonl"
    if not log.is_file():
        print(f"error: {log} does not exist", file=sys.stderr)
        return 2
    events = list(read_events(log, skip=("request_admitted",)))
    if not events:
        print(f"error: {log} holds no events", file=sys.stderr)
        return 2
    try:
        steps = parse_steps(args.steps) if args.steps else None
        out = draw(events, args.out or Path(args.run_dir) / "timeline.png", Path(args.run_dir).name, steps=steps)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

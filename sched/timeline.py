"""Draw who waited for whom: one lane per engine (decode busy / idle, weight loads) and one for the trainer
(train calls, weight publication), from an event log. Works on a real run's or a simulated run's events.jsonl.

    python -m sched.timeline RUN_DIR            # writes RUN_DIR/timeline.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sched.events import Event, read_events
from sched.metrics import engine_spans, summarize, trainer_spans


def draw(events: list[Event], out: str | Path, title: str = "", summary: dict | None = None) -> Path:
    """The timeline of `events` to `out`; `summary`: their `summarize` if the caller has it already."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(e.t for e in events)
    t_end = max(e.t for e in events) - t0
    spans = engine_spans(events, t_end + t0)
    n_eng = max([e.engine for e in events if e.engine >= 0], default=-1) + 1
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.5 * (n_eng + 1)))
    lanes = [f"engine {i}" for i in range(n_eng)] + ["trainer"]
    for i in range(n_eng):
        ax.broken_barh([(0, t_end)], (i - 0.35, 0.7), facecolors="#eeeeee")
        ax.broken_barh([(a - t0, b - a) for a, b in spans.get(i, [])], (i - 0.35, 0.7), facecolors="#4c78a8")
    loads = [e for e in events if e.kind == "weights_loaded"]
    for e in loads:
        ax.plot([e.t - t0], [e.engine], marker="|", color="#e45756", markersize=14)
    tr = n_eng
    ax.broken_barh([(0, t_end)], (tr - 0.35, 0.7), facecolors="#eeeeee")
    ax.broken_barh([(a - t0, b - a) for a, b, _ in trainer_spans(events)], (tr - 0.35, 0.7), facecolors="#f58518")
    done = {e.version: e.t for e in events if e.kind == "train_step_done" and e.data.get("stepped", True)}
    pubs = [(done[e.version] - t0, e.t - done[e.version]) for e in events
            if e.kind == "version_published" and e.version in done]
    ax.broken_barh(pubs, (tr - 0.35, 0.7), facecolors="#e45756")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds")
    m = summary if summary is not None else summarize(events, n_eng)
    ax.set_title(f"{title}  trainer wait {m.get('trainer_wait_ratio', 0):.0%}  "
                 f"engine idle {m.get('engine_idle_ratio', 0):.0%}  "
                 "(blue: decoding, orange: training, red: weight sync)".strip())
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run directory holding events.jsonl")
    ap.add_argument("--out", help="PNG path (default RUN_DIR/timeline.png)")
    args = ap.parse_args(argv)
    log = Path(args.run_dir) / "events.jsonl"
    if not log.is_file():
        print(f"error: {log} does not exist", file=sys.stderr)
        return 2
    events = list(read_events(log))
    if not events:
        print(f"error: {log} holds no events", file=sys.stderr)
        return 2
    out = draw(events, args.out or Path(args.run_dir) / "timeline.png", Path(args.run_dir).name)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

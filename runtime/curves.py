"""Learning and throughput curves of a run: reward, accuracy, response length, tokens/s and staleness over the
steps, from its metrics.jsonl (one row per logged step; a resumed run's file holds every step of the run).

    python -m runtime.curves RUN_DIR            # writes RUN_DIR/curves.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# (panel title, y label, [(metrics.jsonl key, line label)])
PANELS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("reward", "mean reward", (("reward_mean", "mean"),)),
    ("accuracy", "fraction correct", (("accuracy", "mean"),)),
    ("response length", "tokens", (("response_len_mean", "mean"), ("response_len_max", "max"))),
    ("throughput", "tokens/s", (("tokens_per_s", "decoded tokens/s"),)),
    ("staleness", "versions", (("staleness_mean", "mean"), ("staleness_max", "max"))),
)


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a line that is not JSON is an error naming its line."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not a JSON line ({e.msg})") from None
    return rows


def _smooth(ys: list[float], k: int) -> list[float]:
    """Trailing mean over the last k values (fewer at the start)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def draw_curves(rows: list[dict[str, Any]], out: str | Path, title: str = "") -> Any:
    """One panel per PANELS entry, x = step, to the PNG `out`; a series absent from every row is left out of its
    panel (the panel says so). Long runs get a trailing mean over 1/20 of the steps drawn over the raw line.
    Returns the matplotlib Figure (closed: for inspection, not display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("no metrics rows to draw")
    steps = [r.get("step", i + 1) for i, r in enumerate(rows)]
    k = max(1, len(rows) // 20)
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(10, 2.0 * len(PANELS) + 0.6), sharex=True)
    for ax, (name, ylabel, series) in zip(axes, PANELS):
        drawn = 0
        for j, (key, label) in enumerate(series):
            pts = [(s, float(r[key])) for s, r in zip(steps, rows) if isinstance(r.get(key), (int, float))]
            if not pts:
                continue
            xs, ys = zip(*pts)
            color = f"C{j}"
            if k > 1 and j == 0:        # the first series (a mean) smoothed; a max is drawn as it is
                ax.plot(xs, ys, color=color, alpha=0.3, linewidth=0.8)
                ax.plot(xs, _smooth(list(ys), k), color=color, label=f"{label} (mean of {k})")
            else:
                ax.plot(xs, ys, color=color, label=label)
            drawn += 1
        ax.set_title(name if drawn else f"{name} (not in metrics.jsonl)", fontsize=10, loc="left")
        ax.set_ylabel(ylabel)
        if drawn:
            ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(Path(out), dpi=100)
    plt.close(fig)
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    ap.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")
    args = ap.parse_args(argv)
    path = Path(args.run_dir) / "metrics.jsonl"
    if not path.is_file():
        print(f"error: {path} does not exist", file=sys.stderr)
        return 2
    try:
        rows = read_rows(path)
        out = Path(args.out or Path(args.run_dir) / "curves.png")
        draw_curves(rows, out, Path(args.run_dir).name)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""bench/policies.py's preset x correction table: one row per (preset, correction) run, medians over its repeats,
and the one-line summary under it."""
from __future__ import annotations

import math
import statistics
from typing import Any

COLUMNS = ("preset", "correction", "loop s", "samples/s", "tokens/s", "reward", "KL k3", "clipped", "masked",
           "trainer wait", "load", "vs sync")


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def matrix_rows(runs: list[Any]) -> list[dict[str, Any]]:
    """One dict per run (bench/policies.py Run): its figures as medians over the repeats; `vs sync` is sync's loop
    time under the same correction over the run's (NaN when sync did not run that correction)."""
    base = {r.correction: _median(r.makespans) for r in runs if r.preset == "sync"}
    rows = []
    for r in runs:
        loop = _median(r.makespans)
        rows.append({"preset": r.name, "correction": r.correction, "loop s": loop,
                     "samples/s": _median(r.samples) / loop, "tokens/s": _median(r.tokens) / loop,
                     "reward": _median(r.rewards), "KL k3": _median(r.kls), "clipped": _median(r.clipped),
                     "masked": _median(r.masked), "trainer wait": _median(r.waits),
                     "load": statistics.fmean(a for pair in r.loads for a in pair) if r.loads else math.nan,
                     "vs sync": base.get(r.correction, math.nan) / loop})
    return rows


def _cell(key: str, x: Any) -> str:
    if isinstance(x, str):
        return x
    if math.isnan(x):
        return "-"
    if key == "KL k3":
        return f"{x:.2e}"
    if key in ("samples/s", "tokens/s"):
        return f"{x:.1f}"
    if key == "vs sync":
        return f"{x:.2f}x"
    return f"{x:.3f}" if key in ("reward", "clipped", "masked") else f"{x:.2f}"


def matrix_table(runs: list[Any]) -> list[str]:
    """The rows as a Markdown table (the form bench/results/ keeps), header first."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in matrix_rows(runs):
        lines.append("| " + " | ".join(_cell(k, row[k]) for k in COLUMNS) + " |")
    return lines


def matrix_summary(runs: list[Any]) -> str:
    """The last line: the highest reward reached (preset+correction) and every preset's speedup over sync with no
    correction (the correction `none` when it ran, else the first one given)."""
    rows = matrix_rows(runs)
    scored = [r for r in rows if not math.isnan(r["reward"])]
    best = max(scored, key=lambda r: r["reward"]) if scored else None
    top = f"{best['preset']}+{best['correction']} {best['reward']:.3f}" if best else "-"
    ref = "none" if any(r["correction"] == "none" for r in rows) else rows[0]["correction"]
    speed = ", ".join(f"{r['preset']} {_cell('vs sync', r['vs sync'])}" for r in rows
                      if r["correction"] == ref and r["preset"] != "sync")
    return f"reward reached: best {top}; speedup vs sync ({ref}): {speed}"

"""Cost-model constants measured from one of our own runs (a run directory with events.jsonl and metrics.jsonl).

    python train.py --config configs/tiny.toml --log.dir=/tmp/run     # any run of ours, CPU or GPU
    python -m sim.calibrate /tmp/run [--train-ranks N]

What it measures (and how the cpu_tiny profile in sim/profiles.py was filled in):
    decode   the rollout worker sends a tokens_decoded event every `counters_every` (8) engine steps with the engine's
             running total and its step count; between two consecutive ones inside a busy span, dt / steps is the
             step time and d_total / steps the mean batch size n. A least-squares fit of step = k3 * n + k4 gives
             the CPU profile's k3, k4 (k1 = k2 = 0: a tiny model on CPU is compute-bound, its KV reads are
             negligible); a run whose
             intervals all have one batch size gives no slope, only the mean step (step_s) at that batch
    train    step_time_s / trained tokens from metrics.jsonl (median), times the train ranks = s per token on one
             GPU/rank; the trainer's `tokens` counts response tokens only, so pass the mean prompt length
             (--prompt-tokens) to count what the forward pass processes (prompt + response), as sim/cost.py does.
             And `train_fit`: every train call's seconds (train_step_done: step_time_s, its optimizer_steps, its
             tokens as above) fitted by least squares as  time = a * tokens + b * steps + c  with a, b, c >= 0 (the
             best fit over the subsets of terms whose own least-squares coefficients are all >= 0, i.e. exact
             non-negative least squares): a times the train ranks is train_s_per_token, b the cost per optimizer
             step (train_step_s), c per call (train_overhead_s). b and c are told apart only when the calls' step
             counts vary; when every call takes the same s > 0 steps (a sync run: train.minibatches each) the fitted
             fixed time per call F is attributed to its steps, b = F / s and c = 0 (an assumption, reported as
             train_fit_assumed); a term whose column does not vary at all (tokens, or steps) is not fitted (0)
    forward  the share of the train calls' seconds spent in their forward passes (train_step_done: forward_s over
             step_time_s, summed over the calls): `train_forward_share`, what a decoupled-PPO call's proximal pass
             (a no-grad forward of the same micro-batches) costs relative to the call, taking a no-grad forward to
             cost what the forward with grad does (sim/cost.py proximal_share)
    optimizer the optimizer steps' own seconds (train_step_done: optimizer_s over optimizer_steps, summed over the
             calls): `optimizer_step_s`; sync's fixed time per step less it is a minibatch's pass without its step,
             what a call that only accumulates gradients pays (sim/cost.py train_accumulate_s)
    split    (`call_split`, runs whose train_step_done carry passes_s) each call's time taken apart rather than
             fitted: its own fixed time per call `split_call_s`, the mean of (train_started -> train_step_done) less
             its minibatch passes, optimizer steps and proximal pass (the hand-off to the train ranks, advantages,
             metrics); its first pass's extra time over its others (`split_first_pass_extra_s`, train_step_done's
             first_pass_s: cold after the trainer idled, as every sync call comes after its round's generation);
             the rest of the passes fitted as  passes_s = a * tokens + b * passes  (`split_s_per_token`,
             `split_pass_s`: one pass per minibatch, whatever the call's optimizer steps; when every call makes the
             same number of passes b is their fixed time over that number); and `controller_s_per_trajectory`: the
             train leader's CPU outside its trainer thread (train_step_done's other_cpu_start_s / other_cpu_s: the
             controller, its inbox, the watchdog) per trajectory it handled between calls, less the rate it burns
             during calls, when no trajectory arrives (a sync run's calls run with the engines idle)
    publish  train_step_done -> version_published (sched.metrics weight_sync_s)
    load     version_published -> weights_loaded, per engine
    reward   trajectory_finished -> reward_scored, per request
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from sched.events import Event, read_events
from sched.metrics import engine_spans, summarize

COUNTERS_EVERY = 8  # runtime/rollout_worker.py SamplingConfig.counters_every


def decode_fit(events: list[Event]) -> dict[str, float]:
    end = max(e.t for e in events)
    spans = engine_spans(events, end)
    pts: list[tuple[float, float]] = []  # (n, step seconds)
    last: dict[int, Event] = {}
    for e in events:
        if e.kind == "engine_busy":
            last.pop(e.engine, None)
        elif e.kind == "tokens_decoded":
            p = last.get(e.engine)
            same_span = p is not None and any(a <= p.t and e.t <= b for a, b in spans.get(e.engine, []))
            if same_span and e.data["total"] > p.data["total"]:
                # the steps between the two: the worker's count where the events carry it (a CPU engine runs up to
                # cpu_decode_steps of them a call), else every `counters_every` (runs before it was sent)
                steps = e.data["steps"] - p.data["steps"] if "steps" in e.data and "steps" in p.data else COUNTERS_EVERY
                if steps > 0:
                    pts.append(((e.data["total"] - p.data["total"]) / steps, (e.t - p.t) / steps))
            last[e.engine] = e
    busy = sum(b - a for s in spans.values() for a, b in s)
    tokens = sum(e.data.get("tokens", 0) for e in events if e.kind == "trajectory_finished")
    out = {"busy_s": busy, "tokens": float(tokens), "busy_s_per_token": busy / max(tokens, 1), "fit_points": len(pts)}
    if pts:
        mn, ms = statistics.fmean(n for n, _ in pts), statistics.fmean(s for _, s in pts)
        out.update(mean_batch=mn, step_s=ms)
        var = sum((n - mn) ** 2 for n, _ in pts)
        if var > 0:  # a slope needs two batch sizes: a run whose every step is full has none (step_s is its figure)
            k3 = max(0.0, sum((n - mn) * (s - ms) for n, s in pts) / var)
            out.update(k3=k3, k4=max(0.0, ms - k3 * mn))
    return out


def span_fit(events: list[Event]) -> dict[str, float]:
    """Each busy span of each engine as a whole: its seconds (engine_busy -> engine_idle) against the tokens it
    decoded and the engine steps it took (its last tokens_decoded report minus the engine's report before the span:
    the worker reports at the step that empties a busy engine, so the difference is the whole span), fitted as
    span = k3 * tokens + k4 * steps with k3, k4 >= 0 (least squares through the origin, the best non-negative
    subset as train_fit). The fit `decode_fit` makes from the reports inside each span leaves out every span's
    first interval (prefill, the largest batches) and extrapolates its slope from small batches; this one
    reproduces the spans' total, the generation time a run measured. Keys span_k3, span_k4, span_fit_spans,
    span_fit_rms_s; {} without two spans."""
    last: dict[int, Event] = {}
    start: dict[int, tuple[float, Event | None]] = {}
    rows: list[tuple[float, float, float]] = []   # tokens, steps, seconds
    for e in events:
        if e.kind == "engine_busy":
            start[e.engine] = (e.t, last.get(e.engine))
        elif e.kind == "tokens_decoded":
            last[e.engine] = e
        elif e.kind == "engine_idle" and e.engine in start:
            t0, before = start.pop(e.engine)
            end = last.get(e.engine)
            if before is None or end is None or end is before or "steps" not in end.data:
                continue
            steps = end.data["steps"] - before.data.get("steps", 0)
            tokens = end.data["total"] - before.data["total"]
            if steps > 0 and e.t > t0:
                rows.append((float(tokens), float(steps), e.t - t0))
    if len(rows) < 2:
        return {}
    best: tuple[float, dict[int, float]] | None = None
    for cols in ([0, 1], [0], [1]):
        coef = _solve([[r[c] for c in cols] for r in rows], [r[2] for r in rows])
        if coef is None or min(coef) < 0:
            continue
        fit = dict(zip(cols, coef))
        sse = sum((r[2] - sum(fit[c] * r[c] for c in fit)) ** 2 for r in rows)
        if best is None or sse < best[0] - 1e-15:
            best = (sse, fit)
    if best is None:
        return {}
    sse, fit = best
    return {"span_k3": fit.get(0, 0.0), "span_k4": fit.get(1, 0.0), "span_fit_spans": float(len(rows)),
            "span_fit_rms_s": math.sqrt(sse / len(rows))}


def _solve(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares coefficients of ys on the columns of rows (normal equations, Gaussian elimination with
    partial pivoting); None when the columns are linearly dependent."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] * y for r, y in zip(rows, ys))]
         for i in range(k)]
    scale = max(abs(a[i][i]) for i in range(k)) or 1.0
    for c in range(k):
        p = max(range(c, k), key=lambda i: abs(a[i][c]))
        if abs(a[p][c]) <= 1e-12 * scale:
            return None
        a[c], a[p] = a[p], a[c]
        for i in range(k):
            if i != c:
                f = a[i][c] / a[c][c]
                a[i] = [x - f * y for x, y in zip(a[i], a[c])]
    return [a[i][k] / a[i][i] for i in range(k)]


def train_fit(calls: list[tuple[float, float, float]]) -> dict[str, Any]:
    """Fit each train call's seconds as a * tokens + b * optimizer_steps + c with a, b, c >= 0 from calls given as
    (tokens, optimizer steps, seconds): the least-squares fit over the subsets of terms with the smallest residual
    among those whose coefficients are all >= 0 (exact non-negative least squares for three terms). When the step
    count is the same s > 0 in every call, steps and the constant are one column: the fixed time per call is
    attributed to the steps (b = fixed / s, c = 0) and `train_fit_assumed` says so."""
    if not calls:
        return {}
    xs = [(float(t), float(s), 1.0) for t, s, _ in calls]
    ys = [float(y) for _, _, y in calls]
    steps = {s for _, s, _ in xs}
    same_steps = len(steps) == 1
    terms = [0, 2] if same_steps else [0, 1, 2]     # steps fold into the constant when they never vary
    best: tuple[float, dict[int, float]] | None = None
    for mask in range(1, 2 ** len(terms)):
        cols = [terms[i] for i in range(len(terms)) if mask >> i & 1]
        coef = _solve([[x[c] for c in cols] for x in xs], ys)
        if coef is None or min(coef) < 0:
            continue
        fit = dict(zip(cols, coef))
        sse = sum((y - sum(fit.get(c, 0.0) * x[c] for c in fit)) ** 2 for x, y in zip(xs, ys))
        if best is None or sse < best[0] - 1e-15:
            best = (sse, fit)
    sse, fit = best if best is not None else (sum(y * y for y in ys), {})
    a, b, c = fit.get(0, 0.0), fit.get(1, 0.0), fit.get(2, 0.0)
    out: dict[str, Any] = {"train_fit_calls": len(calls), "train_fit_rms_s": math.sqrt(sse / len(calls))}
    (s0,) = steps if same_steps else (None,)
    if same_steps and s0:
        out["train_fit_assumed"] = (f"every call took {s0:g} optimizer steps: its fixed {c:.4g} s is attributed to "
                                    f"them ({c / s0:.4g} s a step), none to the call")
        b, c = c / s0, 0.0
    out.update(train_fit_s_per_token=a, train_step_s=b, train_call_s=c)
    return out


def call_split(events: list[Event], prompt_tokens: float = 0.0) -> dict[str, Any]:
    """A run's train calls taken apart (the module docstring's `split`); {} when its train_step_done events lack
    passes_s or the CPU counters."""
    calls, start = [], None
    for e in events:
        if e.kind == "train_started":
            start = e.t
        elif e.kind == "train_step_done" and start is not None and "passes_s" in e.data:
            calls.append((start, e))
            start = None
    if not calls:
        return {}
    fixed = [e.t - t0 - e.data["passes_s"] - e.data.get("optimizer_s", 0.0) - e.data.get("proximal_s", 0.0)
             for t0, e in calls]
    # a call's first pass takes longer than its others when the trainer idled before it (caches cold after the
    # gap: a sync call always comes after its round's generation), measured where a call makes several passes
    extra = [e.data["first_pass_s"] - (e.data["passes_s"] - e.data["first_pass_s"]) / (e.data["optimizer_steps"] - 1)
             for _, e in calls if "first_pass_s" in e.data and e.data.get("optimizer_steps", 0) > 1]
    first = max(0.0, statistics.fmean(extra)) if extra else 0.0
    passes = [(e.data["tokens"] + prompt_tokens * e.data.get("samples", 0.0),
               max(1.0, e.data.get("optimizer_steps", 1.0)), e.data["passes_s"] - first) for _, e in calls]
    fit = train_fit(passes)
    out: dict[str, Any] = {"split_calls": len(calls), "split_first_pass_extra_s": first,
                           "split_call_s": max(0.0, statistics.fmean(fixed)),
                           "split_s_per_token": fit["train_fit_s_per_token"],
                           "split_pass_s": fit["train_step_s"] + fit["train_call_s"] / statistics.fmean(
                               p for _, p, _ in passes)}
    if all({"other_cpu_start_s", "other_cpu_s"} <= e.data.keys() for _, e in calls):
        during = sum(e.data["other_cpu_s"] - e.data["other_cpu_start_s"] for _, e in calls)
        during_s = sum(e.t - t0 for t0, e in calls)
        rate = during / during_s if during_s > 0 else 0.0
        between = between_s = 0.0
        handled = 0
        for (_, prev), (t0, e) in zip(calls, calls[1:]):
            between += e.data["other_cpu_start_s"] - prev.data["other_cpu_s"]
            between_s += t0 - prev.t
            handled += sum(1 for x in events if x.kind == "trajectory_finished" and prev.t < x.t <= t0)
        out.update(controller_cpu_rate=rate, controller_handled=handled,
                   controller_s_per_trajectory=max(0.0, between - rate * between_s) / handled if handled else 0.0)
    return out


def measure(run_dir: str | Path, train_ranks: int | None = None, prompt_tokens: float = 0.0) -> dict[str, Any]:
    run_dir = Path(run_dir)
    events = list(read_events(run_dir / "events.jsonl"))
    if not events:
        raise ValueError(f"{run_dir}/events.jsonl holds no events")
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]
    engine_ranks = sorted({e.rank for e in events if e.engine >= 0 and e.rank >= 0})
    ranks = train_ranks or (engine_ranks[0] if engine_ranks and engine_ranks[0] > 0 else 1)
    per_tok = [m["step_time_s"] / (m["tokens"] + prompt_tokens * m.get("samples", 0)) for m in metrics
               if m.get("tokens")]
    pub = {e.version: e.t for e in events if e.kind == "version_published"}
    loads = [e.t - pub[e.version] for e in events if e.kind == "weights_loaded" and e.version in pub]
    fin = {e.req_id: e.t for e in events if e.kind == "trajectory_finished"}
    rew = [e.t - fin[e.req_id] for e in events if e.kind == "reward_scored" and e.req_id in fin]
    out: dict[str, Any] = {"run": str(run_dir), "train_ranks": ranks, **decode_fit(events), **span_fit(events)}
    if per_tok:
        out["train_s_per_token_one_rank"] = statistics.median(per_tok) * ranks
    calls = [(e.data["tokens"] + prompt_tokens * e.data.get("samples", 0.0), e.data["optimizer_steps"],
              e.data["step_time_s"]) for e in events
             if e.kind == "train_step_done" and {"tokens", "optimizer_steps", "step_time_s"} <= e.data.keys()]
    fit = train_fit(calls)
    if fit:
        out.update(fit, train_fit_s_per_token_one_rank=fit["train_fit_s_per_token"] * ranks)
    fwd = [(e.data["forward_s"], e.data["step_time_s"]) for e in events
           if e.kind == "train_step_done" and {"forward_s", "step_time_s"} <= e.data.keys()]
    if fwd and sum(t for _, t in fwd) > 0:
        out["train_forward_share"] = sum(f for f, _ in fwd) / sum(t for _, t in fwd)
    opt = [(e.data["optimizer_s"], e.data["optimizer_steps"]) for e in events
           if e.kind == "train_step_done" and {"optimizer_s", "optimizer_steps"} <= e.data.keys()]
    if opt and sum(n for _, n in opt) > 0:
        out["optimizer_step_s"] = sum(t for t, _ in opt) / sum(n for _, n in opt)
    split = call_split(events, prompt_tokens)
    if split:
        out.update(split, split_s_per_token_one_rank=split["split_s_per_token"] * ranks)
    out["publish_s"] = summarize(events).get("weight_sync_s")
    out["load_s"] = statistics.median(loads) if loads else None
    out["reward_s_median"] = statistics.median(rew) if rew else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--train-ranks", type=int, help="train ranks of the run (default: the first engine's rank)")
    ap.add_argument("--prompt-tokens", type=float, default=0.0, help="mean prompt tokens per sample of the run")
    args = ap.parse_args(argv)
    try:
        m = measure(args.run_dir, args.train_ranks, args.prompt_tokens)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for k, v in m.items():
        print(f"{k:28s} {v:.4g}" if isinstance(v, float) else f"{k:28s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

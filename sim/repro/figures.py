"""Figures computed from a simulated run's event log, shared by the papers' rows (each a pure function of a
SimResult, tested on hand-built logs in tests/sim/test_repro_figures.py)."""
from __future__ import annotations

from typing import Callable

from sched.events import Event
from sched.metrics import engine_spans, trainer_spans
from sim.repro.core import Runs, gather
from sim.run import SimResult


def of(r: SimResult, *kinds: str) -> list[Event]:
    """r's events of these kinds, in log order (`SimResult.of`, kept per run; a hand-built result with only an
    `events` list is filtered here)."""
    if isinstance(r, SimResult):
        return r.of(*kinds)
    return [e for e in r.events if e.kind in kinds]


def end_t(r: SimResult) -> float:
    """The latest event time of r's log (`SimResult.end_t`)."""
    return r.end_t if isinstance(r, SimResult) else max(e.t for e in r.events)


def round_figures(r: SimResult) -> dict[str, float]:
    """Per-round means: first dispatch (round start -> first train call of its groups), step time (round start ->
    its last train call's end), and the shares of that step spent before the first dispatch / training."""
    start = {e.data["round"]: e.t for e in of(r, "round_started")}
    g_round = {e.group_id: e.data.get("round", -1) for e in of(r, "group_materialized")}
    first, last, compute = {}, {}, {}
    for a, b, data in trainer_spans(of(r, "train_started", "train_step_done")):
        rounds = {g_round.get(g, -1) for g in data.get("groups", [])}
        for rd in rounds:
            first.setdefault(rd, a)
            last[rd] = b
            compute[rd] = compute.get(rd, 0.0) + (b - a) / len(rounds)
    done = [rd for rd in start if rd in last]
    if not done:
        raise RuntimeError("no round was trained")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    step = {rd: last[rd] - start[rd] for rd in done}
    return {"first_dispatch_s": mean([first[rd] - start[rd] for rd in done]),
            "step_s": mean(list(step.values())),
            "pre_train_share": mean([(first[rd] - start[rd]) / step[rd] for rd in done]),
            "train_share": mean([compute[rd] / step[rd] for rd in done])}


def rollout_idle_ratio(r: SimResult) -> float:
    """Colocated runs: GPU time engines sit idle while the pool is rolling out (before each round's first train
    call), over all GPU time. (In colocated mode engines are held, i.e. training, outside those windows.)"""
    end = end_t(r)
    windows = []
    starts = sorted(e.t for e in of(r, "round_started"))
    firsts = sorted(a for a, _, _ in trainer_spans(of(r, "train_started", "train_step_done")))
    for s in starts:
        f = next((a for a in firsts if a >= s), end)
        windows.append((s, f))
    busy = engine_spans(of(r, "engine_busy", "engine_idle"), end)
    idle = 0.0
    for s, f in windows:
        for i in range(r.num_engines):
            b = sum(max(0.0, min(f, y) - max(s, x)) for x, y in busy.get(i, []))
            idle += (f - s) - b
    return idle / (r.num_engines * (end - starts[0]))


UNITS = ("samples", "tokens")   # what a throughput counts: trained samples, or trained tokens (prompt + response)


def _trained(r: SimResult, unit: str) -> list[tuple[float, float, bool]]:
    """(end time, cumulative samples or tokens trained, whether the call stepped) per train call, in order."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    cum, out = 0.0, []
    for e in of(r, "train_step_done"):
        cum += e.data.get(unit, 0)
        out.append((e.t, cum, e.data.get("stepped", True)))
    return out


def throughput(r: SimResult, unit: str = "samples") -> float:
    """Samples (or tokens: StaleFlow §6.1's and Laminar §8's "tokens processed") trained per second from the first
    round's start to the last train call's end."""
    pts = _trained(r, unit)
    t0 = min(e.t for e in of(r, "round_started"))
    return pts[-1][1] / (pts[-1][0] - t0)


def after_warmup_throughput(r: SimResult, warmup: int = 1, unit: str = "samples") -> float:
    """Samples (or tokens) trained per second between the end of optimizer step `warmup` and the end of the last."""
    pts = [(t, c) for t, c, stepped in _trained(r, unit) if stepped]
    if len(pts) <= warmup:
        raise RuntimeError(f"{r.preset}: only {len(pts)} optimizer steps")
    (t0, c0), (t1, c1) = pts[warmup - 1] if warmup else (0.0, 0.0), pts[-1]
    return (c1 - c0) / (t1 - t0)


def length_bias(r: SimResult) -> dict[str, float]:
    """What a run trained against what it generated: the mean response length of the trained samples and of every
    finished one, their ratio (below 1: the run trains a short-biased subset, which a samples/s throughput rewards),
    finished samples per trained one (over-generation), and the backlog left when the run stopped (materialised
    groups not trained, requests still in flight)."""
    n = tok = 0.0
    for e in of(r, "train_step_done"):
        if e.data.get("samples"):
            n += e.data["samples"]
            tok += e.data["samples"] * e.data.get("response_len_mean", 0.0)
    fin = [e.data.get("tokens", 0) for e in of(r, "trajectory_finished")]
    if not n or not fin:
        raise RuntimeError(f"{r.preset}: nothing trained or finished")
    trained, generated = tok / n, sum(fin) / len(fin)
    return {"trained_len": trained, "generated_len": generated, "bias": trained / generated,
            "overgeneration": len(fin) / n, "backlog_groups": float(r.metrics.get("backlog_groups", float("nan"))),
            "in_flight": float(r.metrics.get("in_flight", float("nan")))}


def generation_tps(r: SimResult) -> float:
    """Rollout-side decode tokens per second over the run (every engine's last counter total / the makespan)."""
    total: dict[int, float] = {}
    for e in of(r, "tokens_decoded"):
        total[e.engine] = e.data.get("total", 0)
    t0 = min(e.t for e in of(r, "round_started"))
    return sum(total.values()) / (end_t(r) - t0)


def reprefill_share(r: SimResult) -> float:
    """Partial rollout's re-prefill (Laminar §2.3): engine-seconds spent recomputing KV that a weight load discarded
    (metrics["reprefill_s"], sim/engine.py), over the engines' busy seconds (rollout time) in the whole run."""
    spans = engine_spans(of(r, "engine_busy", "engine_idle"), end_t(r))
    busy = sum(b - a for s in spans.values() for a, b in s)
    return r.metrics["reprefill_s"] / busy if busy > 0 else 0.0


def round_rollout(r: SimResult) -> dict[int, float]:
    """Per trained round, its rollout time: round start -> the last finish of a response it trained (a kept one:
    scored into a trained group and not discarded)."""
    start = {e.data["round"]: e.t for e in of(r, "round_started")}
    g_round = {e.group_id: e.data["round"] for e in of(r, "group_materialized")}
    trained = {g for e in of(r, "train_started") for g in e.data["groups"]}
    dropped = {e.req_id for e in of(r, "trajectory_aborted")}
    kept = {e.req_id for e in of(r, "reward_scored") if e.group_id in trained and e.req_id not in dropped}
    end: dict[int, float] = {}
    for e in of(r, "trajectory_finished"):
        if e.req_id in kept:
            rd = g_round[e.group_id]
            end[rd] = max(end.get(rd, 0.0), e.t)
    return {rd: t - start[rd] for rd, t in end.items()}


def mean_batch(r: SimResult) -> float:
    """Mean running sequences per decode step over the run's engines (tokens decoded / decode steps)."""
    engines = r.backend.engines
    return sum(e.tokens_total for e in engines) / max(1, sum(e.steps for e in engines))


def speedup(new: tuple, base: tuple, fn: Callable[[SimResult], float] = throughput) -> Callable[[Runs], float | None]:
    """Runs.get(*new) over Runs.get(*base) in `fn` (samples trained per second by default)."""
    def f(runs: Runs) -> float | None:
        a, b = gather([lambda: runs.get(*new), lambda: runs.get(*base)])   # both queued at once
        return None if a is None or b is None else fn(a) / fn(b)
    return f


def metric(preset: tuple, fn: Callable[[SimResult], float]) -> Callable[[Runs], float | None]:
    def f(runs: Runs) -> float | None:
        r = runs.get(*preset)
        return None if r is None else fn(r)
    return f

"""Metrics computed from an event log: the same code for a real run's events.jsonl and for the simulator's.

Definitions (names shared by the runtime, the simulator and the papers' reproduction scripts):
    trainer_wait_ratio      RolloutPipe §5.1: trainer-side wait / (wait + compute), over the run's makespan
    trainer_wait_ratio_eq4  RolloutPipe Eq. 4, per round: (first train start - round start) / (round's train end -
                            round start), averaged over rounds
    engine_idle_ratio       1 - busy decode time / (engines x makespan) (RollPacker's "bubble ratio", suggested form)
    rollout_to_train_end    per round: end of the train call that consumed its last group - round start (mean)
    weight_sync_s           mean time from a publishing step's end to version_published
    staleness               histogram of (trainer version at consumption - generating version) over trained groups
    staleness_at_finish     histogram of (trainer version when the sample finished decoding - its oldest token's
                            version) over finished samples: Laminar §6's "inherent staleness" M - K, which leaves
                            out the time a finished sample waits in the buffer before it is trained
    samples_per_s, tokens_per_s   finished trajectories (and their response tokens) per second of makespan
"""
from __future__ import annotations

from bisect import bisect_right
from collections import Counter, defaultdict
from statistics import mean
from typing import Any, Iterable

from rl.types import Group

from sched.events import Event


def _busy_time(spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, b - a) for a, b in spans)


def engine_spans(events: Iterable[Event], end: float) -> dict[int, list[tuple[float, float]]]:
    """Busy intervals per engine from engine_busy / engine_idle events."""
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    open_at: dict[int, float] = {}
    for e in events:
        if e.kind == "engine_busy" and e.engine not in open_at:
            open_at[e.engine] = e.t
        elif e.kind == "engine_idle" and e.engine in open_at:
            spans[e.engine].append((open_at.pop(e.engine), e.t))
    for eng, t in open_at.items():
        spans[eng].append((t, end))
    return spans


def trainer_spans(events: Iterable[Event]) -> list[tuple[float, float, dict[str, Any]]]:
    """(start, end, train_started data) of every train call."""
    out, start = [], None
    for e in events:
        if e.kind == "train_started":
            start = e
        elif e.kind == "train_step_done" and start is not None:
            out.append((start.t, e.t, start.data))
            start = None
    return out


_TRAINER = frozenset({"train_started", "train_step_done"})
_ENGINE = frozenset({"engine_busy", "engine_idle"})


def _by_kind(events: list[Event]) -> tuple[dict[str, list[Event]], list[Event], list[Event]]:
    """The events grouped by kind, each group in log order, in one pass; and the trainer's two kinds and the engines'
    busy / idle, each pair together in log order (what trainer_spans and engine_spans read)."""
    out: dict[str, list[Event]] = defaultdict(list)
    trainer: list[Event] = []
    engine: list[Event] = []
    for e in events:
        k = e.kind
        out[k].append(e)
        if k in _TRAINER:
            trainer.append(e)
        elif k in _ENGINE:
            engine.append(e)
    return out, trainer, engine


def summarize(events: list[Event], num_engines: int | None = None) -> dict[str, Any]:
    if not events:
        return {}
    by, trainer, engine = _by_kind(events)
    t0 = min(e.t for e in by["round_started"]) if by["round_started"] else events[0].t
    t_end = max(e.t for e in events)
    makespan = max(t_end - t0, 1e-9)
    train = trainer_spans(trainer)
    compute = sum(b - a for a, b, _ in train)
    train_end = train[-1][1] if train else t_end
    wait = max(0.0, (train_end - t0) - compute)
    out: dict[str, Any] = {"makespan_s": makespan, "train_compute_s": compute,
                           "trainer_wait_ratio": wait / max(wait + compute, 1e-9)}

    # per-round figures
    round_start = {e.data["round"]: e.t for e in by["round_started"]}
    group_round = {e.group_id: e.data.get("round", -1) for e in by["group_materialized"]}
    first_start: dict[int, float] = {}
    last_end: dict[int, float] = {}
    for a, b, data in train:
        for g in data.get("groups", []):
            r = group_round.get(g, -1)
            first_start.setdefault(r, a)
            last_end[r] = b
    eq4, r2t = [], []
    for r, ts in round_start.items():
        if r in last_end:
            span = last_end[r] - ts
            r2t.append(span)
            eq4.append((first_start[r] - ts) / span if span > 0 else 0.0)
    if r2t:
        out["rollout_to_train_end_s"] = sum(r2t) / len(r2t)
        out["trainer_wait_ratio_eq4"] = sum(eq4) / len(eq4)

    # engines
    spans = engine_spans(engine, t_end)
    n_eng = num_engines or (max(spans) + 1 if spans else 0)
    if n_eng:
        busy = sum(_busy_time(s) for s in spans.values())
        out["engine_idle_ratio"] = 1.0 - busy / (n_eng * makespan)

    # throughput and staleness
    fin = by["trajectory_finished"]
    out["samples_per_s"] = len(fin) / makespan
    out["tokens_per_s"] = sum(e.data.get("tokens", 0) for e in fin) / makespan
    gen_version = {e.group_id: e.version for e in by["group_materialized"]}
    stale: Counter[int] = Counter()
    for e in by["train_started"]:
        for g in e.data.get("groups", []):
            if g in gen_version:
                stale[e.version - gen_version[g]] += 1
    out["staleness"] = dict(sorted(stale.items()))
    out["staleness_max"] = max(stale) if stale else 0
    steps = sorted((e.t, e.version) for e in by["train_step_done"] if e.data.get("stepped", True))
    step_t = [t for t, _ in steps]
    running_max, v = [], 0
    for _, ver in steps:
        v = max(v, ver)
        running_max.append(v)
    inherent: Counter[int] = Counter()
    for e in fin:
        if e.version >= 0:
            i = bisect_right(step_t, e.t)
            inherent[running_max[i - 1] - e.version if i else 0] += 1  # no step yet: trainer at its start version
    out["staleness_at_finish"] = dict(sorted(inherent.items()))
    out["staleness_at_finish_max"] = max(inherent) if inherent else 0

    # weight sync
    done_t = {e.version: e.t for e in by["train_step_done"] if e.data.get("stepped", True)}
    sync = [e.t - done_t[e.version] for e in by["version_published"] if e.version in done_t]
    if sync:
        out["weight_sync_s"] = sum(sync) / len(sync)
    out["dropped"] = sum(1 for e in by["trajectory_aborted"] if not e.data.get("requeue"))

    # engine faults isolated (Laminar §3.3), and the mechanisms' own counters
    rec = [e.data for e in by["trajectories_recovered"]]
    if rec:
        out["engine_failures"] = len(by["engine_failed"])
        out["engines_retired"] = len({e.engine for e in by["engine_failed"] if e.data.get("permanent")})
        for key in ("resumed", "tokens_kept", "tokens_lost"):
            out[f"failed_engine_{key}"] = sum(d.get(key, 0) for d in rec)
        down = [e.data["down_s"] for e in by["engine_recovered"] if "down_s" in e.data]
        if down:
            out["engine_down_s"] = sum(down) / len(down)
    stats = [e.data for e in by["policy_stats"]]
    if stats:
        out["policy_stats"] = stats[-1]
    return out


def kv_utilisation(events: Iterable[Event], num_engines: int, end: float | None = None) -> float:
    """Average KV-cache utilisation (Laminar Table 1): per engine, kv_used / (kv_used + kv_free) from its
    tokens_decoded counters, held until the next counter (an idle engine reports 0), time-weighted from its first
    counter to the log's end (`end`; default: the latest event's time), then averaged over engines. NaN without
    counters. Only `tokens_decoded` and `engine_idle` events are read, so those alone may be passed, with `end`."""
    evs = list(events)
    if not evs:
        return float("nan")
    if end is None:
        end = max(e.t for e in evs)
    last: dict[int, tuple[float, float]] = {}
    area: dict[int, float] = defaultdict(float)
    span: dict[int, float] = defaultdict(float)
    for e in evs:
        if e.kind == "engine_idle" and e.engine in last:
            t, u = last[e.engine]
            area[e.engine] += u * (e.t - t)
            span[e.engine] += e.t - t
            last[e.engine] = (e.t, 0.0)
        if e.kind != "tokens_decoded":
            continue
        used, free = e.data.get("kv_used", 0), e.data.get("kv_free", 0)
        if e.engine in last:
            t, u = last[e.engine]
            area[e.engine] += u * (e.t - t)
            span[e.engine] += e.t - t
        last[e.engine] = (e.t, used / (used + free) if used + free else 0.0)
    for eng, (t, u) in last.items():
        area[eng] += u * (end - t)
        span[eng] += end - t
    per = [area[i] / span[i] for i in range(num_engines) if span.get(i, 0) > 0]
    return sum(per) / len(per) if per else float("nan")


def rollout_stats(groups: list[Group]) -> dict[str, float]:
    """Per-batch sample statistics the trainer reports with each step (runtime and simulator alike)."""
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        return {}
    lens = [len(t.response_ids) for t in trajs]
    out = {"reward_mean": mean(t.reward or 0.0 for t in trajs),
           "accuracy": mean(1.0 if t.correct else 0.0 for t in trajs),
           "response_len_mean": mean(lens), "response_len_max": float(max(lens)),
           "truncated_frac": mean(1.0 if t.finish_reason == "length" else 0.0 for t in trajs),
           "reward_failed": float(sum(1 for t in trajs if t.meta.get("reward_failed"))),
           "samples": float(len(trajs))}
    if any("turns" in t.meta for t in trajs):   # multi-turn episodes (runtime/episodes.py): their counters
        out.update(turns_mean=mean(t.meta.get("turns", 1) for t in trajs),
                   tool_calls_mean=mean(t.meta.get("tool_calls", 0) for t in trajs),
                   tool_failed_frac=sum(t.meta.get("tool_failures", 0) for t in trajs)
                   / max(1, sum(t.meta.get("tool_calls", 0) for t in trajs)))
    return out

"""Events: what engines, reward scorers and the trainer report, in both worlds (runtime and simulator).

Every event is written to the run's `events.jsonl`; metrics and the timeline picture are computed from that log
by the same code whether it came from torch.distributed ranks or from the simulator's virtual clock.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

_ENCODER = json.JSONEncoder(separators=(",", ":"))   # one encoder: json.dumps with options builds one per call

# Every event kind, and what its fields carry.
KINDS = frozenset({
    "round_started",          # controller pulled a round of prompts (data: prompts, requests)
    "request_admitted",       # dispatch sent a request to an engine
    "tokens_decoded",         # periodic per-engine counters (data: tokens, running, kv_used, kv_free, prefill and
    #                           kv_adopted / kv_refused: tokens re-prefilled, tokens of migrated KV imported or not)
    "tool_started",           # a multi-turn request's model turn ended in a tool call: it waits on the tool, its
    #                           decode slot freed (data: turn, tool)
    "tool_finished",          # its tool call returned (data: turn, seconds, failed); the observation is prefilled
    "trajectory_finished",    # engine finished a sample (data: tokens, finish_reason)
    "reward_scored",          # the sample's reward is known (data: reward, correct, failed)
    "group_materialized",     # all G samples scored: the group is trainable
    "train_started",          # trainer began consuming a batch (data: groups, step, publish)
    "train_step_done",        # optimizer step applied (version = new trainer version; data: metrics)
    "version_published",      # weights of `version` are on every rollout rank's relay
    "weights_received",       # a rollout rank's relay holds `version` (data: seconds receiving, tokens its engine
    #                           decoded from the notice until the relay was filled: decoding does not stop for it)
    "weights_loaded",         # engine adopted `version` (data: running: sequences running at the load, kept_kv:
    #                           how many of them still hold their KV after it: all under an in-flight update)
    "trajectory_aborted", "trajectory_interrupted", "trajectory_migrated",
    "engine_busy", "engine_idle",  # engine activity spans (for the bubble ratio and the timeline)
    "engines_lent",           # engines lent to the trainer or back to rollout (data: engines, lent)
    "engines_added",          # the rollout pool scaled out (data: engines: the new ids)
    "engines_resharded",      # the rollout pool rebuilt at another TP size (data: tp, engines: how many now)
    "engine_failed",          # an engine's step failed (exception, non-finite state, allocation failure) and its rank
    #                           isolated it (data: error, held: {req_id: tokens it held}, permanent: gave up)
    "trajectories_recovered", # the controller took a failed engine's requests back (data: resumed, tokens_kept from
    #                           the partial-response pool, tokens_lost since the last stream, dropped)
    "engine_recovered",       # a failed engine rebuilt and rejoined (version: its weights; data: down_s, reloaded)
    "policy_stats",           # the controller's last word: each mechanism's counters (Policy.stats), by kind
    "rank_failed",
})


@dataclass(slots=True)
class Event:
    kind: str
    t: float                       # seconds since the run started (wall clock or virtual)
    rank: int = -1                 # global rank that produced it (-1: controller)
    engine: int = -1
    req_id: int = -1
    group_id: int = -1
    version: int = -1
    data: dict[str, Any] = field(default_factory=dict)
    payload: Any = field(default=None, repr=False, compare=False)  # in-process only (e.g. a Trajectory); not logged

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown event kind {self.kind!r}")

    def to_json(self) -> str:
        """One line: the set ids (rank, engine, req_id, group_id, version), data, kind, t (to the microsecond);
        the bytes json.dumps gives for that dict, written directly (the log's hot path: ~800 events a step)."""
        parts = [f'"{k}":{int(v)}' for k, v in (("rank", self.rank), ("engine", self.engine), ("req_id", self.req_id),
                                              ("group_id", self.group_id), ("version", self.version)) if v != -1]
        if self.data:
            parts.append('"data":' + _ENCODER.encode(self.data))
        t = round(self.t, 6)
        parts.append(f'"kind":"{self.kind}","t":{float(t)!r}' if isinstance(t, float) else f'"kind":"{self.kind}","t":{int(t)}')
        return "{" + ",".join(parts) + "}"

    @classmethod
    def from_json(cls, line: str) -> "Event":
        return cls(**json.loads(line))


# The per-request kinds: three lines per sample, 95% of a run's log. A compact log writes each run of consecutive
# ones as one `requests` line (encode_requests); read_events expands it back into the same events, in the same order.
REQUEST_KINDS = ("request_admitted", "trajectory_finished", "reward_scored")
REQUESTS = "requests"             # the kind of a compact line (a log's, never an Event's)
_IDS = ("rank", "engine", "req_id", "group_id", "version")
_BATCH_MAX = 4096                 # events per compact line at most


def _col(values: list[Any], t: bool = False) -> Any:
    """One column of a compact line, in its shortest of these forms: {"c": v} (every value v), {"us": [..]} (`t`:
    microseconds, each from the one before), {"d": [..]} (integers, each from the one before), {"v": [distinct],
    "i": "0102.."} (few distinct values: a character each, '0' + index), or the plain list."""
    keys = [_ENCODER.encode(v) for v in values]
    if len(set(keys)) == 1:
        return {"c": values[0]}
    if t:
        us = [int(round(v * 1_000_000)) for v in values]
        return {"us": [b - a for a, b in zip([0] + us, us)]}
    if all(type(v) is int for v in values):
        return {"d": [b - a for a, b in zip([0] + values, values)]}
    distinct = list(dict.fromkeys(keys))
    if len(distinct) <= 64:
        return {"v": [json.loads(k) for k in distinct], "i": "".join(chr(48 + distinct.index(k)) for k in keys)}
    return values


def _uncol(col: Any, n: int) -> list[Any]:
    """`_col`'s inverse: the column's n values."""
    if isinstance(col, list):
        return col
    if "c" in col:
        return [col["c"]] * n
    if "v" in col:
        return [col["v"][ord(c) - 48] for c in col["i"]]
    out, acc = [], 0
    for d in col.get("d", col.get("us")):
        acc += d
        out.append(acc)
    return [v / 1_000_000 for v in out] if "us" in col else out


def encode_requests(events: list[Event]) -> str:
    """One JSON line holding `events` (per-request kinds) column-wise (_col): a table per (kind, data keys), with a
    column per set id, `t` and each data key, and `order`, the table of each event in turn (a character each: '0' +
    index). The values are those `Event.to_json` writes (t to the microsecond): decoding gives back equal events."""
    tables: dict[tuple[str, tuple[str, ...]], list[Event]] = {}
    order = []
    for e in events:
        key = (e.kind, tuple(e.data))
        if key not in tables:
            tables[key] = []
        order.append(chr(48 + list(tables).index(key)))
        tables[key].append(e)
    out = []
    for (kind, keys), rows in tables.items():
        tab: dict[str, Any] = {"kind": kind, "n": len(rows), "t": _col([round(e.t, 6) for e in rows], t=True)}
        for f in _IDS:
            col = [int(getattr(e, f)) for e in rows]
            if any(v != -1 for v in col):
                tab[f] = _col(col)
        if keys:
            tab["data"] = {k: _col([e.data[k] for e in rows]) for k in keys}
        out.append(tab)
    return _ENCODER.encode({"kind": REQUESTS, "order": "".join(order), "tables": out})


def decode_requests(line: str) -> list[Event]:
    """`encode_requests`' inverse: the events of one compact line, in their order."""
    d = json.loads(line)
    cols = []
    for tab in d["tables"]:
        n = tab["n"]
        cols.append((tab["kind"], _uncol(tab["t"], n), {f: _uncol(tab[f], n) for f in _IDS if f in tab},
                     {k: _uncol(v, n) for k, v in tab.get("data", {}).items()}))
    pos = [0] * len(cols)
    out = []
    for c in d["order"]:
        i = ord(c) - 48
        kind, t, ids, data = cols[i]
        j = pos[i]
        pos[i] += 1
        out.append(Event(kind, t[j], **{f: v[j] for f, v in ids.items()}, data={k: v[j] for k, v in data.items()}))
    return out


class EventLog:
    """Append-only JSONL event log (or in-memory only when path is None). `compact`: runs of consecutive per-request
    events (REQUEST_KINDS) are written as one `requests` line each (encode_requests), about a quarter of their size
    one per line; read_events gives back the same events either way."""

    def __init__(self, path: str | Path | None = None, keep: bool = True, compact: bool = False):
        self.path = Path(path) if path else None
        self._f: IO[str] | None = open(self.path, "a") if self.path else None
        self.keep = keep
        self.compact = compact
        self.events: list[Event] = []
        self._pending: list[Event] = []    # per-request events not yet written (compact)

    def write(self, ev: Event) -> None:
        if self.keep:
            self.events.append(ev)
        if self._f is None:
            return
        if self.compact and ev.kind in REQUEST_KINDS:
            self._pending.append(ev)
            if len(self._pending) >= _BATCH_MAX:
                self._drain()
            return
        self._drain()
        self._f.write(ev.to_json() + "\n")

    def _drain(self) -> None:
        if self._pending and self._f is not None:
            self._f.write(encode_requests(self._pending) + "\n")
        self._pending = []

    def flush(self) -> None:
        """Write what is held back, then flush the file: its length is then a line boundary after every event so
        far (what a checkpoint's log mark needs)."""
        if self._f is not None:
            self._drain()
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._drain()
            self._f.close()
            self._f = None


def read_events(path: str | Path, skip: tuple[str, ...] = ()) -> Iterator[Event]:
    """The events of a JSONL log, in order, compact `requests` lines expanded; kinds in `skip` are passed over
    (without being parsed, on plain lines)."""
    marks = tuple(f'"kind":"{k}"' for k in skip)
    compact = f'{{"kind":"{REQUESTS}"'
    with open(path) as f:
        for line in f:
            if line.startswith(compact):
                if not all(k in skip for k in REQUEST_KINDS):
                    yield from (e for e in decode_requests(line) if e.kind not in skip)
            elif line.strip() and not any(m in line for m in marks):
                yield Event.from_json(line)

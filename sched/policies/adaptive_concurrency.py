"""Adaptive in-flight concurrency: prime-rl's orchestrator cap (prime-rl `docs/inference.md`, "Adaptive Concurrency";
configs/sched/adaptive_concurrency.toml).

    adaptive_concurrency  dispatch  a version-lag admission (lag_cap's rule) under an in-flight cap n_max (requests
                                    on the engines) that the engines' KV capacity, KV pressure and preemptions move
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import Dispatch, register
from sched.decisions import Submit
from sched.intake import OneBatchAhead, admit_within_lag
from sched.views import Views

CUT = 0.75          # HARD: n_max <- 0.75 x in flight (prime-rl docs/inference.md)
DRAIN_CUT = 0.5     # HARD that survives a full drain: n_max x 0.5 (same)
GROW = 1.02         # CLEAR at every poll of a step, with the cap binding: kappa x 1.02 (same)
BINDS = 0.9         # the cap binds: in flight >= 0.9 x n_max (same)
EWMA = 0.1          # weight of a finished request in G's moving average (ours: prime-rl does not state its weight)


class Signal(enum.IntEnum):
    """An engine's overload at a poll (prime-rl: "binary per-engine overload signal, worst engine wins")."""
    CLEAR = 0
    SOFT = 1        # its waiting queue was non-empty at two consecutive polls
    HARD = 2        # it preempted since the last poll


@register
class AdaptiveConcurrency(OneBatchAhead, Dispatch):
    """An in-flight cap sized from the KV budget and trimmed by overload feedback (prime-rl `docs/inference.md`,
    "Adaptive Concurrency": "Safety must come from admission-time budgeting; feedback only trims the budget's
    error"). In flight: requests on the engines (running or queued there), counted in samples:

        n_max = clamp(kappa x C / G, group_size, max_inflight)

    C: the engines' KV capacity in tokens, (kv_used + kv_free) x kv_block_size as each last reported (the decode
    profile's kv_tokens before its first report). G: the expected request cost in tokens, a moving average of
    prompt + response tokens of the requests that finished (until the first one: n_max stays where it is). kappa:
    the over-commit factor, 1 at first. Every `poll_s` the engines' counters give each a signal, the worst wins:
    HARD (preemptions rose) cuts n_max to 0.75 x in flight at once, then no further cut until in flight drains
    below it; a HARD that survives that drain halves n_max. SOFT holds. kappa follows each cut (kappa = n_max x
    G / C, our reading: so the next re-evaluation keeps the cut). n_max is re-evaluated once per optimizer step:
    kappa grows x 1.02 if every poll of the step was CLEAR and the cap bound (in flight >= 0.9 x n_max at a poll).
    During the first step the feedforward is frozen (n_max = `initial_inflight`) and only the HARD cut is live; at
    its end kappa = max(1, n_max x G / C).

    Not modelled: prime-rl's per-environment weighting of G (one task here) and its refill burst cap. Admission
    otherwise follows the `lag_cap` dispatch's rule (sched/policies/lag_cap.py; how far rollout may run ahead of the
    trainer, in versions): whole groups, oldest first, to the ready engine with the fewest requests, while groups
    started < (lag + u + 1) x batch, u the engine's version; a group whose requests came back pending resumes
    without counting again; intake keeps one batch of prompts waiting.

    Invariant kept: group_size <= n_max <= max_inflight (when set) at every decision; a group starts only if the
    requests in flight, it included, stay within n_max; the lag cap's invariant."""
    name = "adaptive_concurrency"
    paper = "prime-rl adaptive concurrency (docs/inference.md): n_max = clamp(kappa C / G), cut on preemptions"
    reads_counters = True

    @dataclass
    class Params:
        lag: int = F(1, ge=0, help="versions a started group may lag (rollout ahead of the trainer): groups started "
                                   "< (lag + u + 1) x batch, u the engine's version (the lag_cap dispatch's rule)")
        max_inflight: int = F(0, ge=0, help="ceiling of the in-flight cap, in samples (prime-rl's "
                                            "orchestrator.concurrency.max_inflight; 0: capacity-driven, none)")
        initial_inflight: int = F(0, ge=0, help="the cap during the first step, in samples (prime-rl's "
                                                "initial_inflight; 0: one batch, prompts_per_step x group_size)")
        poll_s: float = F(5.0, gt=0, help="seconds between overload polls of the engines' counters (prime-rl polls "
                                          "every 5 s)")

    def __init__(self, params: "AdaptiveConcurrency.Params | None" = None):
        super().__init__(params)
        self.admitted = 0                    # groups started, cumulative
        self.pulled = 0                      # groups pulled into the pipeline, cumulative
        self.cap = 0.0                       # n_max (0: not set yet)
        self.kappa = 1.0
        self.g: float | None = None          # G, tokens per request
        self.cursor: dict[int, int] = {}     # round -> its finishes already read
        self.pre: dict[int, int] = {}        # engine -> preemptions at the last poll
        self.waited: dict[int, bool] = {}    # engine -> its queue was non-empty at the last poll
        self.polled = -math.inf
        self.frozen = False                  # a HARD cut happened; no other until in flight drains below n_max
        self.clear, self.bound = True, False # every poll of this step CLEAR; the cap bound at a poll of it
        self.step = 0                        # trainer version n_max was last re-evaluated at
        self.inflight = 0                    # requests on the engines, counting those placed in this decision
        self.history: list[tuple[float, float, str]] = []   # (time, n_max, why) at every change
        self.low, self.high = math.inf, 0.0

    def counters_period_s(self) -> float:
        return self.p.poll_s

    # ------------------------------------------------------------------------------------------- the cap
    def limits(self, v: Views) -> tuple[float, float]:
        return float(v.group_size), float(self.p.max_inflight) if self.p.max_inflight else math.inf

    def capacity(self, v: Views) -> float:
        """C, in tokens, over the engines in rollout."""
        total = 0.0
        for e in v.engines:
            if e.lent or e.failed:
                continue
            blocks = e.kv_used + e.kv_free
            if blocks and v.kv_block_size:
                total += blocks * v.kv_block_size
            elif v.decode_profile is not None:
                total += v.decode_profile.kv_tokens
        return total

    def set_cap(self, v: Views, value: float, why: str) -> None:
        lo, hi = self.limits(v)
        value = min(max(value, lo), hi)
        if value != self.cap:
            self.cap = value
            self.history.append((v.now, value, why))
            self.low, self.high = min(self.low, value), max(self.high, value)

    def feedforward(self, v: Views, why: str) -> None:
        C = self.capacity(v)
        if C > 0 and self.g:
            self.set_cap(v, self.kappa * C / self.g, why)

    def follow(self, v: Views) -> None:
        """kappa after a cut, so that the next re-evaluation keeps it."""
        C = self.capacity(v)
        if C > 0 and self.g:
            self.kappa = self.cap * self.g / C

    def observe(self, v: Views) -> None:
        """G from the requests that finished since the last decision."""
        for r, ids in v.finishes.items():
            start = self.cursor.get(r, 0)
            for q in ids[start:]:
                req = v.requests.get(q)
                if req is not None:
                    ctx = float(req.prompt_len + req.tokens)
                    self.g = ctx if self.g is None else (1 - EWMA) * self.g + EWMA * ctx
            self.cursor[r] = len(ids)
        for r in [r for r in self.cursor if r not in v.finishes]:
            del self.cursor[r]

    def poll(self, v: Views) -> Signal:
        sig = Signal.CLEAR
        for e in v.engines:
            if e.lent or e.failed:
                continue
            if e.preemptions > self.pre.get(e.engine, e.preemptions):
                sig = Signal.HARD
            elif e.waiting > 0 and self.waited.get(e.engine, False):
                sig = max(sig, Signal.SOFT)
            self.pre[e.engine], self.waited[e.engine] = e.preemptions, e.waiting > 0
        n = self.inflight
        if sig == Signal.HARD:
            self.clear = False
            if not self.frozen:
                self.frozen = True
                self.set_cap(v, CUT * n, "hard: preemptions")
                self.follow(v)
            elif n < self.cap:
                self.set_cap(v, DRAIN_CUT * self.cap, "hard after a drain")
                self.follow(v)
        elif sig == Signal.SOFT:
            self.clear = False
        elif self.frozen and n < self.cap:
            self.frozen = False
        if n >= BINDS * self.cap:
            self.bound = True
        return sig

    def reevaluate(self, v: Views) -> None:
        """Once per optimizer step (the first step's end: the freeze exits)."""
        if v.trainer.version <= self.step:
            return
        first = self.step == 0
        self.step = v.trainer.version
        C = self.capacity(v)
        if first:
            if C > 0 and self.g:
                self.kappa = max(1.0, self.cap * self.g / C)
        elif self.clear and self.bound:
            self.kappa *= GROW
        self.feedforward(v, "step")
        self.clear, self.bound = True, False

    # -------------------------------------------------------------------------------------------- admission
    def admit(self, v: Views) -> list[Submit]:
        self.inflight = sum(e.assigned for e in v.engines)
        if not self.cap:
            self.set_cap(v, self.p.initial_inflight or v.prompts_per_step * v.group_size, "initial")
        self.observe(v)
        self.reevaluate(v)
        if v.now - self.polled >= self.p.poll_s:
            self.polled = v.now
            self.poll(v)
        out, self.admitted, placed = admit_within_lag(v, self.admitted, self.p.lag, room=self.cap - self.inflight)
        self.inflight += placed
        return out

    def stats(self) -> dict[str, float]:
        cuts = sum(1 for _, _, why in self.history if why.startswith("hard"))
        return {"n_max": self.cap, "n_max_low": self.low, "n_max_high": self.high, "kappa": self.kappa,
                "hard_cuts": float(cuts)}

    def state_dict(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "pulled": self.pulled, "cap": self.cap, "kappa": self.kappa, "g": self.g,
                "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.admitted, self.pulled = int(state.get("admitted", 0)), int(state.get("pulled", 0))
        self.cap, self.kappa = float(state.get("cap", 0.0)), float(state.get("kappa", 1.0))
        self.g, self.step = state.get("g"), int(state.get("step", 0))

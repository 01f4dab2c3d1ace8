"""RollPacker's stream trainer (§4.4, Algorithm 1): once 20-50% of a round's responses are done, half the rollout
engines are lent to the trainer, which computes (and buffers) the gradients of the finished prompts on them while
the other half finishes the round; at the round's end every GPU takes the rest and the one optimizer step.

    stream_trainer  handoff   finished groups stream to the trainer only while it has GPUs of its own
    ScaleDown                 the scale-down decision (used by the `rollpacker` rebalance, rebalance.py)

The optimizer semantics are StreamRL's `stream` update (gradients accumulate, one step per round, renormalised by
the sample count: sched/policies/streamrl/update.py, paired in the preset); what this module adds is *where* the
gradients are computed.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import Handoff, register
from sched.decisions import LendEngines, Migrate, ReturnEngines
from sched.views import IN_FLIGHT, RequestState, Views

S = RequestState


@register
class StreamTrainerHandoff(Handoff):
    """Completed prompts stream to the trainer (Table 4's asynchronous fetching: every materialised group of the
    oldest round once at least `min_groups` are waiting) while the trainer has GPUs of its own: engines lent by the
    scale-down, or, disaggregated, its own partition. Colocated with none lent, rollout holds every GPU, so
    Algorithm 1 computes nothing until the scale-down ("if scaled_down: compute_grad"), and the round's groups go
    together at its end. Pair with the `stream` update.

    Invariant kept: whole materialised groups of a single round, each handed over once."""
    name = "stream_trainer"
    paper = "RollPacker §4.4 (Algorithm 1 l.22: gradients only on repurposed GPUs; Table 4 asynchronous fetching)"

    @dataclass
    class Params:
        min_groups: int = F(1, ge=1, help="groups worth a train call mid-round (the round's last groups go anyway)")

    def ready(self, v: Views) -> list[int] | None:
        queue, last = v.ready_in_oldest_round()
        if not queue:
            return None
        if not last and (len(queue) < self.p.min_groups or (v.colocated and not any(e.lent for e in v.engines))):
            return None
        return [g.group_id for g in queue]


@dataclass
class ScaleDownParams:
    first: float = 0.2          # the first milestone: share of the round's responses done
    last: float = 0.5           # the last one
    step: float = 0.05          # more responses done since the last attempt before another ("dR / |R| >= 5%")
    fraction: float = 0.5       # share of the rollout engines lent ("repurpose half of rollout GPUs")
    kv_tokens: int = 0          # each engine's KV pool in tokens (0: from the engines' counters)
    block_size: int = 16        # tokens per KV block in the engines' counters
    history: int = 4096         # finished response lengths the projection reads (the latest)


class ScaleDown:
    """Algorithm 1's scale-down, once per round: when the share of the round's responses done is in [first, last]
    and at least `step` more are done than at the last attempt, try to lend `fraction` of the rollout engines (whole
    engines, i.e. whole TP groups, never split): the ones with the fewest requests, whose running requests then
    migrate to the others whole group by group (recomputation-based migration: tokens kept, KV recomputed).
    The attempt goes ahead only if the projected peak KV demand of the round's live requests fits the engines that
    stay: each live request at prompt + E[final length | longer than its tokens so far], the expectation over the
    latest finished response lengths ("historical response length distributions with per-token cache footprints").
    When the round's rollout is over (nothing of it pending or on an engine), the engines come back, so the last
    train call runs on every GPU. Only on a backend that can lend engines (`Views.elastic`).

    Invariant kept: an engine is lent only empty of running work (its requests are migrated in the same decision),
    at least one engine stays in rollout, and every lent engine is back before the next round starts."""

    def __init__(self, p: ScaleDownParams):
        self.p = p
        self.round = -1
        self.cursor = 0               # finishes of the round read so far
        self.tried_at = -1            # responses done at the last attempt (-1: none yet)
        self.lent: list[int] = []
        self.done_with_round = False
        self.lengths: deque[int] = deque(maxlen=p.history)   # latest finished response lengths
        self.attempts = self.scaled = 0

    def plan(self, v: Views) -> list[Migrate | LendEngines | ReturnEngines]:
        if not v.elastic or v.round < 0:
            return []
        if v.round != self.round:
            self.round, self.cursor, self.tried_at, self.done_with_round = v.round, 0, -1, False
        finishes = v.round_finishes(self.round)
        for i in finishes[self.cursor:]:
            r = v.requests.get(i)
            if r is not None:
                self.lengths.append(r.tokens)
        self.cursor = len(finishes)
        if v.requests.count(*IN_FLIGHT) == 0:        # the round's rollout is over (rounds are synchronous)
            out: list[Any] = [ReturnEngines(self.lent)] if self.lent else []
            self.lent, self.done_with_round = [], True
            return out
        if self.lent or self.done_with_round:
            return []
        total = sum(v.groups[g].size for g in v.round_groups.get(self.round, []))
        done = len(finishes)
        frac = done / max(1, total)
        if not self.p.first <= frac <= self.p.last or (self.tried_at >= 0 and done - self.tried_at < self.p.step
                                                         * total):
            return []
        self.tried_at, self.attempts = done, self.attempts + 1
        return self.attempt(v)

    def attempt(self, v: Views) -> list[Migrate | LendEngines]:
        pool = v.rollout_engines()
        k = int(len(pool) * self.p.fraction)
        if k < 1 or k >= len(pool):
            return []
        loads = v.engine_loads()
        lend = sorted(pool, key=lambda e: (loads[e], e))[:k]
        stay = [e for e in pool if e not in lend]
        if not self.fits(v, stay):
            return []
        out: list[Any] = []
        load = {e: loads[e] for e in stay}
        moving: dict[tuple[int, int], list[int]] = {}         # (source engine, group) -> its running requests there
        for r in v.requests.in_state(S.RUNNING):
            if r.engine in lend:
                moving.setdefault((r.engine, r.group_id), []).append(r.req_id)
        for (src, _), ids in sorted(moving.items()):
            dst = min(stay, key=lambda e: (load[e], e))
            load[dst] += len(ids)
            out.append(Migrate(src, dst, ids))
        self.lent, self.scaled = lend, self.scaled + 1
        return out + [LendEngines(lend)]

    def fits(self, v: Views, stay: list[int]) -> bool:
        cap = self.p.kv_tokens
        if not cap:
            counted = [v.engines[e].kv_used + v.engines[e].kv_free for e in stay]
            if not all(counted):
                return False                      # no KV pool known: no projection, no scale-down
            cap = min(counted) * self.p.block_size
        hist = sorted(self.lengths)
        if not hist:
            return False
        tail = [0] * (len(hist) + 1)               # tail[i] = sum of hist[i:]
        for i in range(len(hist) - 1, -1, -1):
            tail[i] = tail[i + 1] + hist[i]
        need = 0.0
        for r in v.requests.in_state(S.PENDING, S.RUNNING, S.INTERRUPTING):
            if r.round != self.round:
                continue
            j = bisect.bisect_right(hist, r.tokens)
            final = tail[j] / (len(hist) - j) if j < len(hist) else max(r.tokens, hist[-1])
            need += r.prompt_len + final
        return need <= cap * len(stay)

    def state_dict(self) -> dict[str, Any]:
        return {"lengths": list(self.lengths)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lengths = deque(state.get("lengths", []), maxlen=self.p.history)

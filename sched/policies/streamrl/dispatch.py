"""Skewness-aware dispatch: StreamRL §5.1 / §5.3 (Algorithm 2's long-tail instances with their small batches, the
LPT scheduling order), with the output-length ranker of §5.2 (sched/policies/streamrl/length_rank.py)."""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import Dispatch, register
from sched.decisions import Submit
from sched.policies.streamrl.length_rank import PREDICTORS
from sched.policies.streamrl.resource_split import split_instances
from sched.views import ON_ENGINE, GroupState, Views


@dataclass(frozen=True)
class RoundSplit:
    """How one round is spread: the engines for the predicted regular and long-tail prompts, and the long-tail
    engines' batch cap (requests in flight each; 0: none)."""
    regular: tuple[int, ...]
    long: tuple[int, ...]
    long_batch: int


@register
class SkewnessDispatch(Dispatch):
    """A few long responses keep a decode batch nearly empty for most of a round ("skewness bubbles"): per-token
    latency PTL(BS) grows with batch size, so mixing long-tail samples into big batches of regular ones makes
    everyone slow (Eq. 1-2). Each round, the prompts are ranked by predicted output length (§5.2's ranker, refreshed
    online from every finished sample); the predicted-longest `long_fraction` (alpha, the paper's 20%) go to a few
    dedicated engines "with smaller batch sizes", the rest spread over the others (§5.1). How many engines the long
    tail gets (N_l) and its batch size come from Algorithm 2 every round (`split_instances`: Eq. 2 for each class
    at L_a = P90 and L_r = P50 of the latest finished lengths, from the engines' profiled decode step
    `Views.decode_profile`), unless fixed by `long_engines` / `long_batch`; with no profile and nothing fixed, no
    engine is dedicated (LPT ordering alone). A long-tail engine holds at most its batch size of requests (the rest
    wait here, longest first; a group always fits on an idle engine). Groups are admitted longest first (Graham's
    LPT, §5.3: "samples are assigned to the batch in descending order of their estimated output lengths"), each
    onto the engine of its class with the least predicted work in flight. Intake: synchronous rounds.

    Invariant kept: only placement and admission order change, never which samples are generated or under which
    weights; a group never spans engines."""
    name = "skewness"
    paper = "StreamRL §5.1 / §5.3 (Algorithm 2 each round, LPT order) with the §5.2 length ranker"

    @dataclass
    class Params:
        long_fraction: float = F(0.2, ge=0, le=1, help="alpha: share of a round's prompts predicted longest")
        long_engines: int = F(-1, ge=-1, help="engines for them (-1: Algorithm 2 picks N_l each round)")
        long_batch: int = F(-1, ge=-1, help="requests in flight per long-tail engine (-1: Algorithm 2's batch "
                                            "size; 0: no cap)")
        objective: str = F("sum", choices=("sum", "max"), help="Algorithm 2's objective: the sum of the two "
                                                                "classes' latencies as printed, or their max")
        predictor: str = F("learned", choices=tuple(sorted(PREDICTORS)),
                           help="output-length ranker (streamrl/length_rank.py): learned (online regression on "
                                "the prompt's tokens, §5.2) | history (past lengths of the prompt) | prompt_length")

    def __init__(self, params: "SkewnessDispatch.Params | None" = None):
        super().__init__(params)
        self.ranker = PREDICTORS[self.p.predictor]()
        self.pred: dict[int, float] = {}               # group -> predicted response length (frozen at ranking)
        self.long: set[int] = set()                    # groups predicted in the long tail
        self.splits: dict[int, RoundSplit] = {}        # round -> its split
        self.work: dict[int, tuple[int, float]] = {}   # request in flight -> (engine, predicted length)
        self.cursor: dict[int, int] = {}               # round -> its finishes read so far
        self.recent: deque[int] = deque(maxlen=4096)   # latest finished lengths (Algorithm 2's D)
        self.ranked: dict[int, float] = {}             # group id -> its prediction when ranked (diagnostics)
        self.chosen: deque[tuple[int, RoundSplit]] = deque(maxlen=64)   # (round, split): what Algorithm 2 chose

    def admit(self, v: Views) -> list[Submit]:
        self.observe(v)
        for r, gids in v.round_groups.items():
            if r not in self.splits:
                self.rank(v, r, gids)
        by_group = v.pending_by_group()
        if not by_group:
            return []
        load = {e: 0.0 for e in v.rollout_engines()}
        count = v.engine_loads()
        for eng, pred in self.work.values():
            load[eng] = load.get(eng, 0.0) + pred
        out: dict[int, list[int]] = {}
        for gid in sorted(by_group, key=lambda g: (-self.pred[g], g)):            # LPT
            ids, split = by_group[gid], self.splits[v.groups[gid].round]
            pool = [e for e in (split.long if gid in self.long and split.long else split.regular) if e in count]
            if gid in self.long and split.long and split.long_batch:
                pool = [e for e in pool if count[e] == 0 or count[e] + len(ids) <= split.long_batch]
            if not pool:
                continue                                                           # waits for a small batch slot
            eng = min(pool, key=lambda e: (load[e], e))
            out.setdefault(eng, []).extend(ids)
            load[eng] += self.pred[gid] * len(ids)
            count[eng] += len(ids)
            self.work.update({i: (eng, self.pred[gid]) for i in ids})
        return [Submit(e, ids) for e, ids in sorted(out.items())]

    def rank(self, v: Views, r: int, gids: list[int]) -> None:
        """Predict the round's lengths, mark its predicted-longest alpha, and choose its split (Algorithm 2)."""
        for g in gids:
            grp = v.groups[g]
            self.pred[g] = self.ranker.predict(grp.prompt_index, v.requests[grp.req_ids[0]].prompt_len,
                                               _prompt_ids(grp))
            self.ranked[g] = self.pred[g]
        while len(self.ranked) > 16384:
            del self.ranked[next(iter(self.ranked))]
        k = math.ceil(self.p.long_fraction * len(gids) - 1e-9)
        self.long |= set(sorted(gids, key=lambda g: (-self.pred[g], g))[:k])
        pool = v.rollout_engines()
        n_long, cap = self.p.long_engines, self.p.long_batch
        prof = v.decode_profile
        if n_long < 0 and prof is not None and len(pool) > 1 and gids:
            prompt = statistics.fmean(v.requests[v.groups[g].req_ids[0]].prompt_len for g in gids)
            est = [self.pred[g] for g in gids for _ in range(v.groups[g].size)]
            sp = split_instances(est, len(pool), lambda bs, L: prof.ptl(bs, prompt + L / 2),
                                 lambda L: prof.max_batch(prompt + L), self.p.long_fraction,
                                 list(self.recent) or None, self.p.objective)
            n_long, cap = sp.long, (sp.long_batch if cap < 0 else cap)
        n_long = min(max(n_long, 0), len(pool) - 1) if k else 0
        split = RoundSplit(tuple(pool[:len(pool) - n_long]), tuple(pool[len(pool) - n_long:]),
                           max(cap, 0) if n_long else 0)
        self.splits[r] = split
        self.chosen.append((r, split))

    def observe(self, v: Views) -> None:
        """Teach the ranker the lengths of newly finished requests and take them off their engines' work; forget
        requests that left otherwise (aborted, interrupted) and rounds that are gone."""
        for r in v.round_groups:
            fin = v.round_finishes(r)
            for i in fin[self.cursor.get(r, 0):]:
                q = v.requests.get(i)
                if q is not None:
                    self.ranker.observe(q.prompt_index, q.prompt_len, q.tokens, _prompt_ids(v.groups.get(q.group_id)))
                    self.recent.append(q.tokens)
                self.work.pop(i, None)
            self.cursor[r] = len(fin)
        if len(self.work) > v.requests.count(*ON_ENGINE):
            self.work = {i: w for i, w in self.work.items() if i in v.requests and v.requests[i].state in ON_ENGINE}
        if len(self.splits) > len(v.round_groups):
            live = set(v.round_groups)
            self.splits = {r: s for r, s in self.splits.items() if r in live}
            self.cursor = {r: c for r, c in self.cursor.items() if r in live}
            self.pred = {g: p for g, p in self.pred.items() if g in v.groups}
            self.long &= set(self.pred)

    def state_dict(self) -> dict[str, Any]:
        return {"ranker": self.ranker.state_dict(), "recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ranker.load_state_dict(state.get("ranker", {}))
        self.recent = deque(state.get("recent", []), maxlen=self.recent.maxlen)


def _prompt_ids(g: GroupState | None) -> Any:
    """The group's prompt token ids, when its prompt is known (the learned ranker reads them)."""
    return g.prompt.prompt_ids if g is not None and g.prompt is not None else None

"""Skewness-aware dispatch: StreamRL §5.3 (Algorithm 2's long-tail instances and the LPT scheduling order), with
the output-length ranker of §5.2 (sched/policies/streamrl/length_rank.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from config import F
from sched.base import Dispatch, Submit, register
from sched.policies.streamrl.length_rank import PREDICTORS
from sched.views import ON_ENGINE, GroupState, RequestState, Views


@register
class SkewnessDispatch(Dispatch):
    """A few long responses keep a decode batch nearly empty for most of a round ("skewness bubbles"): per-token
    latency PTL(BS) grows with batch size, so mixing long-tail samples into big batches of regular ones makes
    everyone slow (Eq. 1-2). At each round the prompts are ranked by predicted output length; the predicted-longest
    `long_fraction` (alpha, the paper's 20%) go to `long_engines` dedicated engines that run small batches (at most
    `long_batch` requests in flight each; more wait here), the rest spread over the other engines. Groups are
    admitted longest first (Graham's LPT, §5.3: "samples are assigned to the batch in descending order of their
    estimated output lengths"), each onto the engine of its class with the least predicted work in flight.
    Finished responses refresh the predictor (the paper's online fine-tuning). How many engines to dedicate is
    Algorithm 2's choice (`resource_split.split_instances`); here it is a parameter. With one engine this is LPT
    ordering alone. Intake: synchronous rounds.

    Invariant kept: only placement and admission order change, never which samples are generated or under which
    weights; a group never spans engines."""
    name = "skewness"
    paper = "StreamRL §5.3 (Algorithm 2, LPT order) with the §5.2 length ranker"

    @dataclass
    class Params:
        long_fraction: float = F(0.2, ge=0, le=1, help="alpha: share of a round's prompts predicted longest")
        long_engines: int = F(1, ge=0, help="engines reserved for them (at most all but one)")
        long_batch: int = F(0, ge=0, help="requests in flight per long-tail engine (0: no cap; a group always "
                                          "fits on an idle engine)")
        predictor: str = F("history", choices=tuple(sorted(PREDICTORS)),
                           help="output-length ranker (streamrl/length_rank.py): history (past lengths of the "
                                "prompt) | prompt_length | learned (online regression on its tokens, §5.2)")

    def __init__(self, params: "SkewnessDispatch.Params | None" = None):
        super().__init__(params)
        self.ranker = PREDICTORS[self.p.predictor]()
        self.pred: dict[int, float] = {}               # group -> predicted response length (frozen at ranking)
        self.long: set[int] = set()                    # groups predicted in the long tail
        self.work: dict[int, tuple[int, float]] = {}   # request in flight -> (engine, predicted length)

    def admit(self, v: Views) -> list[Submit]:
        self.observe(v)
        by_group = v.pending_by_group()
        for gids in v.round_groups.values():
            if any(g not in self.pred for g in gids):
                self.rank(v, gids)
        n = len(v.engines)
        n_long = min(self.p.long_engines, n - 1)
        pools = (list(range(n - n_long)), list(range(n - n_long, n)))   # regular, long-tail
        load = [0.0] * n
        count = [e.assigned for e in v.engines]
        for eng, pred in self.work.values():
            load[eng] += pred
        out: dict[int, list[int]] = {}
        for gid in sorted(by_group, key=lambda g: (-self.pred[g], g)):           # LPT
            ids, pool = by_group[gid], pools[gid in self.long and n_long > 0]
            if pool is pools[1] and self.p.long_batch:
                pool = [e for e in pool if count[e] == 0 or count[e] + len(ids) <= self.p.long_batch]
            if not pool:
                continue                                                          # waits for a small batch slot
            eng = min(pool, key=lambda e: (load[e], e))
            out.setdefault(eng, []).extend(ids)
            load[eng] += self.pred[gid] * len(ids)
            count[eng] += len(ids)
            self.work.update({i: (eng, self.pred[gid]) for i in ids})
        return [Submit(e, ids) for e, ids in sorted(out.items())]

    def rank(self, v: Views, gids: list[int]) -> None:
        for g in gids:
            grp = v.groups[g]
            self.pred[g] = self.ranker.predict(grp.prompt_index, v.requests[grp.req_ids[0]].prompt_len,
                                               _prompt_ids(grp))
        k = math.ceil(self.p.long_fraction * len(gids) - 1e-9)
        self.long |= set(sorted(gids, key=lambda g: (-self.pred[g], g))[:k])

    def observe(self, v: Views) -> None:
        """Forget requests that left their engine; teach the ranker the lengths of the finished ones."""
        for i in [i for i in self.work if i not in v.requests or v.requests[i].state not in ON_ENGINE]:
            q = v.requests.get(i)
            if q is not None and q.state == RequestState.FINISHED:
                grp = v.groups.get(q.group_id)
                self.ranker.observe(q.prompt_index, q.prompt_len, q.tokens, _prompt_ids(grp))
            del self.work[i]
        self.pred = {g: p for g, p in self.pred.items() if g in v.groups}
        self.long &= set(self.pred)

    def state_dict(self) -> dict[str, Any]:
        return {"ranker": self.ranker.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ranker.load_state_dict(state.get("ranker", {}))


def _prompt_ids(g: GroupState | None) -> Any:
    """The group's prompt token ids, when its prompt is known (the learned ranker reads them)."""
    return g.prompt.prompt_ids if g is not None and g.prompt is not None else None

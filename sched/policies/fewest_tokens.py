"""An example of a new mechanism, included verbatim in the README ("Add a policy"): a dispatch that sends each
pending group, whole, to the engine with the fewest tokens in flight (no paper). Tests run it in the simulator and on
real ranks (tests/sched/test_policy_example.py)."""
from __future__ import annotations

from dataclasses import dataclass

from config import F
from sched.base import Dispatch, register
from sched.decisions import Submit
from sched.views import ON_ENGINE, Views, least_loaded


@register
class FewestTokens(Dispatch):
    """Each pending group, whole, to the engine with the fewest tokens in flight: prompt + response tokens so far
    (as last reported) of the requests it holds, plus the prompts this call already sent there. At most
    `max_groups_per_call` groups per decision. Intake: the base class's synchronous rounds.
    Invariant kept: a group never spans engines."""
    name = "fewest_tokens"
    paper = "none: the README's example of a new mechanism"

    @dataclass
    class Params:
        max_groups_per_call: int = F(8, ge=1, help="groups admitted per decision")

    def admit(self, v: Views) -> list[Submit]:
        load = {e.engine: 0 for e in v.engines}       # local bookkeeping: the views are the controller's
        for r in v.requests.in_state(*ON_ENGINE):
            load[r.engine] += r.prompt_len + r.tokens
        out: dict[int, list[int]] = {}
        for ids in list(v.pending_by_group().values())[: self.p.max_groups_per_call]:
            eng = least_loaded(load)
            out.setdefault(eng, []).extend(ids)
            load[eng] += sum(v.requests[i].prompt_len for i in ids)
        return [Submit(e, ids) for e, ids in sorted(out.items())]

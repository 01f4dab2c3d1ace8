"""Stream handoff: StreamRL §4.1 "dynamic-batch pipelining" (and RollPacker §4.4's asynchronous fetching)."""
from __future__ import annotations

from dataclasses import dataclass

from config import F
from sched.base import Handoff, register
from sched.views import Views


@register
class StreamHandoff(Handoff):
    """Samples are "immediately sent to the training stage as soon as completed", and "the training stage can start
    as soon as it receives enough samples to saturate the GPUs": whenever the trainer is idle it gets every
    materialised group of the oldest round that is waiting, once at least `min_groups` are (B_sat; the paper gives
    no value, 1 = as soon as anything is ready), or once they are all that is left of the round. The streaming unit
    is the whole group, since GRPO's advantages need all of a prompt's responses. Batches grow with the generation
    speed: small while the short responses pour in, larger when the trainer was busy. Pair with the `stream`
    update (one step after the whole round), so the result equals one on-policy step on the round's whole batch.

    Invariant kept: whole materialised groups of a single round, each handed over once."""
    name = "stream"
    paper = "StreamRL §4.1 dynamic-batch pipelining; RollPacker §4.4 asynchronous fetching"

    @dataclass
    class Params:
        min_groups: int = F(1, ge=1, help="B_sat in groups: the smallest batch worth a train call "
                                          "(the round's last groups go anyway)")

    def ready(self, v: Views) -> list[int] | None:
        queue, last = v.ready_in_oldest_round()
        if len(queue) >= self.p.min_groups or (queue and last):
            return [g.group_id for g in queue]
        return None

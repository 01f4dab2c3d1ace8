"""Windowed FIFO hand-off: MiniMax Forge's bounded reordering as TitanRL ships it (configs/sched/windowed_fifo.toml).

    windowed_fifo  handoff  batches of `batch` groups, oldest first, taken only from a window of W groups anchored
                            at the oldest group not yet trained: at most W - 1 younger groups overtake a straggler
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from config import F
from sched.base import Handoff, Preset, register
from sched.views import Views


@register
class WindowedFifo(Handoff):
    """Consume groups oldest-first, but let at most W - 1 younger groups overtake a straggler (MiniMax Forge, arXiv
    2605.26494 §6.2.4, as torchtitan `experiments/rl/docs/windowed_fifo.md` implements it). Groups are ordered by
    group id, which is the order the `lag_cap` dispatch starts them in. The window is the W groups from the
    anchor, the oldest group neither trained nor void; it is anchored there, so training a younger group inside it
    does not slide it forward: nothing beyond anchor + W - 1 is trained while the anchor is not. A batch is formed
    as TitanRL's batcher forms it, one group at a time: the oldest materialised group inside the window joins it,
    and once the anchor itself joins, the window moves to the next untaken group. Until `batch` groups have
    joined, the trainer waits (back-pressure). W = 1 is strict FIFO.

    Bound (windowed_fifo.md, "Offpolicy bound"): with the `lag_cap` dispatch's lag S (TitanRL's target off-policy
    steps, active buffer (S + 1) x P) and P groups per batch, a group is trained at most S + ceil((W - 1) / P)
    versions after the version it started on. The bound it declares to the controller is S + W - 1 (the same for
    P = 1, looser for larger P: `staleness_bound` does not know P); tests check the tight one.

    Invariant kept: no group is trained while an untrained, non-void group W or more positions older waits (at
    most W - 1 younger groups overtake any group); batches are exactly `batch` groups, each handed over once."""
    name = "windowed_fifo"
    paper = "MiniMax Forge windowed FIFO (arXiv 2605.26494 §6.2.4; TitanRL docs/windowed_fifo.md)"

    @dataclass
    class Params:
        window: int = F(4, ge=1, help="W: groups the window spans from the oldest untrained group; at most W - 1 "
                                      "younger groups overtake it (1: strict FIFO). TitanRL derives it as "
                                      "max(1, floor(0.3 x (S + 1) x P))")
        groups: int = F(0, ge=0, help="groups per training batch (0: the run's prompts_per_step)")

    def bind(self, preset: Preset) -> None:
        lag = getattr(preset.dispatch.p, "lag", None) if preset.dispatch.name == "lag_cap" else None
        self.lag: int | None = lag

    def staleness_bound(self) -> int | None:
        return None if self.lag is None else self.lag + self.p.window - 1

    def tight_bound(self, prompts_per_step: int) -> int | None:
        """S + ceil((W - 1) / P) (windowed_fifo.md), P the batch in groups; None without the lag_cap dispatch."""
        if self.lag is None:
            return None
        return self.lag + math.ceil((self.p.window - 1) / (self.p.groups or prompts_per_step))

    def ready(self, v: Views) -> list[int] | None:
        B = self.p.groups or v.prompts_per_step
        if v.groups.count_ready() < B:
            return None
        untaken = [g.group_id for g in v.open_groups()]          # oldest first; the anchor is the first of them
        ready = [g.group_id for g in v.ready_groups()]
        taken: list[int] = []
        while len(taken) < B:        # TitanRL's batcher: one group at a time, the anchor sliding only once taken
            anchor = untaken[0]
            pick = next((gid for gid in ready if gid < anchor + self.p.window), None)
            if pick is None:
                return None                                  # the window holds nothing ready: wait for the anchor
            taken.append(pick)
            ready.remove(pick)
            untaken.remove(pick)
        return taken

    def batch_groups(self, prompts_per_step: int) -> int | None:
        return self.p.groups or prompts_per_step

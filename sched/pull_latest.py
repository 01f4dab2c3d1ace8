"""Pull-latest weight sync: Laminar's trajectory-level asynchrony, §2.4, §3.2 steps 5-7 and §6 ("each rollout
updates as soon as its batch generation is completed or released").

An engine that has nothing of its batch left (every trajectory finished, or handed to another engine by a repack)
loads the newest PUBLISHED version at once, on its own: no barrier, no waiting for any other engine, and never under
a running trajectory, so each trajectory is generated under exactly one version (§9). An engine still holding
trajectories keeps its version until they are done, however many versions the trainer publishes meanwhile; nor is
an engine reloaded while a repack is moving trajectories onto it (they must land on the version they started on).

The relay: Laminar keeps the latest weights in CPU memory on every rollout machine, filled by a chained broadcast
from the trainer, so a pull is a local host-to-device copy and the trainer never waits for engines (§4). Our
runtime already has exactly this shape: trainer/publish.py broadcasts the full tensors in buckets to every rollout
rank, which keeps them in its `relay` (runtime/rollout_worker.py, a CPU copy of the latest published version), and
`LoadWeights` copies the relay into the engine. The relay's chained-broadcast time model is
`sim.cost.relay_broadcast_s` (Laminar App. C).

Invariant kept: engines load only published versions, only when they hold no trajectory, versions only increase.
"""
from __future__ import annotations

from sched.base import LoadWeights, Views, WeightSync, register
from sched.repack import migrating_to


@register
class PullLatest(WeightSync):
    name = "pull_latest"

    def engines_to_load(self, v: Views) -> list[LoadWeights]:
        latest = v.trainer.published
        return [LoadWeights(e.engine, latest) for e in v.engines
                if e.version < latest and not e.loading and e.assigned == 0 and not migrating_to(v, e.engine)]

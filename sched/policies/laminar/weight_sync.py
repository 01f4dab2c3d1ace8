"""Pull-latest weight sync: Laminar's trajectory-level asynchrony, §2.4, §3.2 steps 5-7 and §6."""
from __future__ import annotations

from sched.base import WeightSync, register
from sched.decisions import LoadWeights
from sched.views import Views


@register
class PullLatest(WeightSync):
    """"Each rollout updates as soon as its batch generation is completed or released": an engine that has nothing
    of its batch left (every trajectory finished, or handed to another engine by a repack) loads the newest
    PUBLISHED version at once, on its own: no barrier, no waiting for any other engine, and never under a running
    trajectory, so each trajectory is generated under exactly one version (§9). An engine still holding
    trajectories keeps its version, however many versions the trainer publishes meanwhile; nor is an engine
    reloaded while a repack is moving trajectories onto it (they must land on the version they started on), nor
    while it is failed (it loads once it rejoined, §3.3).

    Invariant kept: engines load only published versions, only when they hold no trajectory; versions only
    increase."""
    name = "pull_latest"
    paper = "Laminar §2.4, §3.2 steps 5-7, §6"
    skips_failed_engines = True

    def engines_to_load(self, v: Views) -> list[LoadWeights]:
        latest = v.trainer.published
        return [LoadWeights(e.engine, latest) for e in v.engines
                if e.version < latest and not e.loading and e.assigned == 0 and not e.failed
                and not v.migrating_to(e.engine)]

"""In-flight weight update: PipelineRL's defining mechanism (arXiv 2509.19128)."""
from __future__ import annotations

from sched.base import WeightSync, register
from sched.decisions import LoadWeights
from sched.views import Views


@register
class InFlight(WeightSync):
    """In-flight weight update (PipelineRL, arXiv 2509.19128: the engine "receives updated model weights with
    minimal interruption during the generation of token sequences"; its inference server pauses between decode
    steps, loads the broadcast weights and resumes). Every engine adopts each published version as soon as it
    appears, busy or not, and its running sequences KEEP the KV the older weights computed (`LoadWeights.keep_kv`:
    no preemption, no re-prefill): only the tokens decoded from then on come from the new weights, and are tagged
    with its version. PipelineRL (its Figure 7) reports the off-policyness of the stale KV as negligible. This is
    the difference from `areal`, whose load discards the KV and recomputes it (AReaL v0.3's interrupt).

    An engine lent to the trainer is left alone until it is back (verl's sleeping Hybrid replicas skip the weight
    sync, `verl_hybrid`); it then adopts the newest version before it takes a request.

    Invariant kept: engines move only to published, newer versions; a trajectory's oldest token version is the
    version it started under; its per-token versions never decrease."""
    name = "in_flight"
    paper = "PipelineRL in-flight weight updates, KV kept (arXiv 2509.19128)"
    keeps_kv = True

    def engines_to_load(self, v: Views) -> list[LoadWeights]:
        ps = v.trainer.published
        return [LoadWeights(e.engine, ps, keep_kv=self.keeps_kv) for e in v.engines
                if e.version < ps and not e.loading and not e.lent]

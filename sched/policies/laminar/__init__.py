"""Laminar (configs/sched/laminar.toml): trajectory-level asynchrony. Every engine generates its own batch of whole
groups on one weight version and, the moment the batch is done (or released by a repack), pulls the newest
published weights from its relay and takes a new batch; no global sync. Staleness is not bounded, it emerges.

    dispatch.py     laminar            dispatch     per-engine batches (§3.2 steps 1-3, §5-§6)
    handoff.py      experience_buffer  handoff      the trainer samples B completed groups (§3.1-3.2, App. A.3)
    weight_sync.py  pull_latest        weight_sync  an emptied engine loads the newest version on its own (§2.4, §6)
    rebalance.py    repack             rebalance    Best-Fit consolidation of long-tail engines (§5, Algorithm 1)

The relay: Laminar keeps the latest weights in CPU memory on every rollout machine, filled by a chained broadcast
from the trainer, so a pull is a local host-to-device copy and the trainer never waits for engines (§4). The runtime
has exactly this shape: trainer/publish.py broadcasts the full tensors in buckets to every rollout rank, which keeps
them in its relay (runtime/rollout_worker.py), and `LoadWeights` copies the relay into the engine. The relay's
chained-broadcast time model is `sim.cost.relay_broadcast_s` (App. C).
"""
from sched.policies.laminar import dispatch, handoff, rebalance, weight_sync  # noqa: F401  (registration)

"""StaleFlow (configs/sched/staleflow.toml, staleflow_vanilla.toml): staleness-bounded asynchronous RL. The preset's
routing dispatch is a Design (sched/base.py): one object that also fills the weight sync and the migration, and
runs the paper's coordination pass as one function. Read algorithm1.py first.

    algorithm1.py   staleflow / staleflow_vanilla  dispatch     the design: Algorithm 1 (§5.2) over routing, sync
                                                                and migration on one snapshot; TS intake (§5.1)
    routing.py      the routing strategies: Algorithm 3 (§5.3) and the vanilla one (§6.5)
    sync.py         staleflow / staleflow_vanilla  weight_sync  Algorithm 4 / vanilla (§6.5): parts of the design
    migration.py    staleflow                      rebalance    Algorithm 5 (§5.3): a part of the design
    handoff.py      staleflow                      handoff      Consume of Ready buffers (§4.2)
    state.py        the shared parameters and state; the snapshot (Eq. 1); how the paper's pieces map onto ours
    buffers.py      the staleness manager's virtual buffers: Reserve / Occupy / Consume (§4.2-4.3)
    aborts.py       the staleness manager's Aborts: batch / group redundancy, uniform and stuck filters (§4.3)
    store.py        the trajectory store (TS) in MLQ order, Alg. 2's routability check (§5.1, §5.3)
    cost.py         the throughput model of Eq. 2-4 (Table 4)
"""
from sched.policies.staleflow import algorithm1, handoff, migration, sync  # noqa: F401  (registration)

"""StaleFlow (configs/sched/staleflow.toml, staleflow_vanilla.toml): staleness-bounded asynchronous RL. Four
mechanisms of one design, sharing one parameter set and one state (state.py), both owned by the routing dispatch:

    dispatch.py     staleflow / staleflow_vanilla  dispatch     routing, Algorithms 2-3 (§5.3) / vanilla (§6.5)
    handoff.py      staleflow                      handoff      Consume of Ready buffers (§4.2)
    weight_sync.py  staleflow / staleflow_vanilla  weight_sync  per-instance sync, Algorithm 4 / vanilla (§6.5)
    rebalance.py    staleflow                      rebalance    migration, Algorithm 5 (§5.3)
    buffers.py      the staleness manager's virtual buffers: Reserve / Occupy / Consume (§4.2-4.3)
    aborts.py       the staleness manager's Aborts: batch / group redundancy, uniform and stuck filters (§4.3)
    store.py        the trajectory store (TS) in MLQ order, Alg. 2's routability check (§5.1, §5.3)
    cost.py         the throughput model of Eq. 2-4 (Table 4)
    state.py        the shared parameters and state; how the paper's pieces map onto the runtime's
"""
from sched.policies.staleflow import dispatch, handoff, rebalance, weight_sync  # noqa: F401  (registration)

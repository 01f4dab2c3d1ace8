"""StreamRL (configs/sched/streamrl.toml, streamrl_async.toml): stream generation and skewness-aware dispatch.

    dispatch.py        skewness  dispatch   Algorithm 2's long-tail engines with small batches, LPT order (§5.1, §5.3)
    handoff.py         stream    handoff    finished groups to the trainer as they materialise (§4.1)
    update.py          stream    update     accumulate, one optimizer step per round (§4.1; RollPacker §4.4)
    length_rank.py     the output-length rankers behind `skewness` (§5.2)
    scale_out.py       scale_out rebalance  dynamic scale-out of the rollout pool (§4.2, Fig. 11)
    resource_split.py  Algorithms 1-2 as pure functions over cost curves: Algorithm 2 runs in `skewness` every
                       round; Algorithm 1 in the simulator's planner (sim/split.py, `python -m sim split`)
"""
from sched.policies.streamrl import dispatch, handoff, scale_out, update  # noqa: F401  (registration)

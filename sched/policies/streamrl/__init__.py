"""StreamRL (configs/sched/streamrl.toml, streamrl_async.toml): stream generation and skewness-aware dispatch.

    dispatch.py        skewness  dispatch   predicted-longest prompts on dedicated engines, LPT order (§5.3)
    handoff.py         stream    handoff    finished groups to the trainer as they materialise (§4.1)
    update.py          stream    update     accumulate, one optimizer step per round (§4.1; RollPacker §4.4)
    length_rank.py     the output-length rankers behind `skewness` (§5.2)
    resource_split.py  Algorithms 1-2: the generation/training split and the long-tail instance count, as pure
                       functions over cost curves (an analysis utility: no preset calls it yet)
"""
from sched.policies.streamrl import dispatch, handoff, update  # noqa: F401  (registration)

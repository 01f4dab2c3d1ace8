"""The papers' scheduling mechanisms, one module per paper, or one folder with a file per mechanism kind once a
paper passes ~300 lines. The code behind configs/sched/<paper>.toml lives in sched/policies/<paper>; a preset that
combines papers (fgd_tailbatch, streamrl_async, staleflow_vanilla) reuses their modules, and the baselines' own
mechanisms live in sync.py (synchronous rounds), one_step.py, partial_rollout.py and areal.py.

    sync.py             fifo, whole_round, step_publish, barrier, none     the synchronous baseline
    rolloutpipe.py      frontier, cgp, every_u                             RolloutPipe
    rollpacker.py       tail_batching, tail_abort                          RollPacker
    streamrl/           skewness, stream (handoff), stream (update)        StreamRL
    laminar/            laminar, experience_buffer, pull_latest, repack    Laminar
    staleflow/          staleflow (x4), staleflow_vanilla (x2)             StaleFlow
    one_step.py         one_step, oldest_round                             one-step off-policy baseline
    partial_rollout.py  partial_rollout                                    partial-rollout baseline
    areal.py            areal (dispatch, handoff, weight_sync)             AReaL / VeRL-Async baseline
    fewest_tokens.py    fewest_tokens                                      the README's example of a new mechanism

`python -m sched` prints the registry (kind, name, file, paper section). Importing this package registers every
module above; a new mechanism is one more import here.
"""
from sched.policies import areal, fewest_tokens, one_step, partial_rollout, rolloutpipe, rollpacker, sync  # noqa: F401
from sched.policies import laminar, staleflow, streamrl  # noqa: F401

"""The papers' scheduling mechanisms, one module per paper, or one folder with a file per mechanism kind once a
paper passes ~300 lines. The code behind configs/sched/<paper>.toml lives in sched/policies/<paper>; a preset that
combines papers (fgd_tailbatch, streamrl_async, staleflow_vanilla) reuses their modules, and the baselines' own
mechanisms live in sync.py (synchronous rounds), one_step.py, partial_rollout.py and areal.py; the 2025-26 designs
(pipelinerl, windowed_fifo, pacing, april, adaptive_concurrency) reuse areal's weight sync and Laminar's buffer and
weight sync; pipelinerl and windowed_fifo start groups through lag_cap.py, adaptive_concurrency by its rule.

    sync.py             fifo, whole_round, step_publish, barrier, none     the synchronous baseline
    rolloutpipe.py      frontier, cgp, every_u                             RolloutPipe
    rollpacker.py       tail_batching, tail_abort                          RollPacker
    streamrl/           skewness, stream (handoff), stream (update)        StreamRL
    laminar/            laminar, experience_buffer, pull_latest, repack    Laminar
    staleflow/          staleflow (x4), staleflow_vanilla (x2)             StaleFlow
    one_step.py         one_step, oldest_round                             one-step off-policy baseline
    partial_rollout.py  partial_rollout                                    partial-rollout baseline
    areal.py            areal (dispatch, handoff, weight_sync)             AReaL / VeRL-Async baseline
    lag_cap.py          lag_cap                                            PipelineRL max_lag, TitanRL active buffer
    pipelinerl/         pipelinerl (handoff), in_flight                    PipelineRL (KV kept across a weight load)
    windowed_fifo.py    windowed_fifo                                      MiniMax Forge / TitanRL windowed FIFO
    pacing.py           pacing                                             tinker-cookbook pacing instead of dropping
    april.py            april (dispatch, rebalance)                        APRIL over-provisioning, partials carried
    adaptive_concurrency.py  adaptive_concurrency                          prime-rl adaptive in-flight concurrency
    verl_hybrid.py      verl_hybrid                                        verl dynamic scheduling (simulator only)
    fewest_tokens.py    fewest_tokens                                      the README's example of a new mechanism

`python -m sched` prints the registry (kind, name, file, paper section). Importing this package imports every module
and subpackage in this folder, in name order, which registers their mechanisms: a new mechanism is one more file (or
folder) here, with no import to add anywhere. A paper's folder imports its own mechanism files in its __init__.py.
"""
import importlib
import pkgutil

# every module and subpackage of this folder, imported in name order (the order the registry is filled in)
MODULES = tuple(importlib.import_module(f"{__name__}.{m.name}")
                for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name))

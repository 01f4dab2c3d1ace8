"""PipelineRL (arXiv 2509.19128; ServiceNow/PipelineRL), ScaleRL's default asynchronous setting "PipelineRL-k"
(arXiv 2510.13786): configs/sched/pipelinerl.toml.

    lag_cap     dispatch     (sched/policies/lag_cap.py) the actor's `max_lag` back-pressure: groups started <
                             (max_lag + u + 1) x batch; no concurrency cap beyond the engine's own batch
    pipelinerl  handoff      the trainer takes batches in arrival order; samples more than max_lag versions behind
                             are counted (PipelineRL's `samples_too_old_to_train`) or, on request, dropped
    in_flight   weight_sync  every engine adopts each published version between two decode steps, its running
                             sequences keeping the KV the older weights computed (the in-flight weight update)
"""
from sched.policies.pipelinerl import handoff, weight_sync  # noqa: F401  (registration)

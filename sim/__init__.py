"""Discrete-event simulator: the same sched/ policies and Controller as the runtime, driven on a virtual clock by
simulated engines and a simulated trainer (docs/architecture.md, "Simulator").

    clock.py     event queue on a virtual clock
    cost.py      the cost model (decode step, prefill, train, weight sync, reward latency)
    profiles.py  named calibrations, every constant with its source
    workload.py  response-length distributions per paper setting, and trace replay
    episodes.py  multi-turn, tool-using episodes: tool calls, observation tokens, tool latency (a distribution or a
                 recorded trace); the agentic workload
    engine.py    simulated engine: continuous batching, paged KV, preemption by recompute
    backend.py   SimBackend: the controller's Backend protocol; emits the runtime's events
    run.py       simulate(...) -> SimResult (events, metrics, timing)
    compare.py   `python -m sim.compare`: every preset on one workload, a table and timelines
    repro/       `python -m sim.repro PAPER`: our numbers beside a paper's (core.py, figures.py, a module per paper)
    calibrate.py `python -m sim.calibrate RUN_DIR`: cost constants from a real run of ours
    validate.py  `python -m sim.validate`: every preset's speedup over sync, simulated against our real runs
"""
from sim.cost import CostModel, RewardLatency, RewardTask
from sim.profiles import PROFILES, get_profile
from sim.run import SimResult, simulate
from sim.episodes import AgenticWorkload, load_latency_trace  # (registers the multi-turn workloads)
from sim.workload import WORKLOADS, LengthModel, TraceError, TraceWorkload, get_workload, load_trace, save_trace

__all__ = ["CostModel", "RewardLatency", "RewardTask", "PROFILES", "get_profile", "SimResult", "simulate", "WORKLOADS",
           "LengthModel", "AgenticWorkload", "load_latency_trace", "TraceError", "TraceWorkload", "get_workload",
           "load_trace", "save_trace"]

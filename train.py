"""GRPO with verifiable rewards: a rollout partition of decode engines and an FSDP2 train partition, scheduled by
a pluggable policy (sched/). One entry point for every rank.

    # the tiny offline default (random tiny model, synthetic task): 1 rollout rank + 3 train ranks on CPU
    torchrun --nproc_per_node=4 train.py --config configs/tiny.toml
    # any key can be overridden from the command line
    torchrun --nproc_per_node=4 train.py --config configs/tiny.toml --train.steps=20 --sched.preset=sync
    # check a config on any machine (no GPU, no weights): rank plan, data, memory plan for the target GPU
    python train.py --config configs/qwen3-1.7b-math-8gpu.toml --check
    # one GPU: engine and trainer share the device (colocated)
    torchrun --nproc_per_node=1 train.py --config configs/X.toml --cluster.colocate=true
    # two nodes of 8: run this on each node, with the same rendezvous endpoint
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 train.py --config C

Global rank 0 is the train leader and runs the controller (sched/controller.py) in its main thread and the
trainer in a second thread; the other train ranks follow it through FSDP2 collectives; rollout ranks run
runtime/rollout_worker.py. Everything a run writes goes to its run directory: config.toml, events.jsonl,
metrics.jsonl, timeline.png, checkpoints/ and the exported model in hf/.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import sched as policies
from config import ConfigError, build, load_config
from runtime.build import build_run, device_for_rank, make_run_dir, model_for_rank
from runtime import watchdog
from runtime.channel import Channel
from runtime.logger import MetricsLogger
from runtime.topology import init_distributed, partition_cores, pin_to_cores, split_ranks
from sched.controller import Controller


def parse_args(argv: list[str]) -> tuple[str | None, list[str]]:
    path, rest = None, []
    it = iter(argv)
    for a in it:
        if a == "--config":
            path = next(it, None)
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
    return path, rest


def main(argv: list[str]) -> int:
    # 1. configuration: every mistake is reported here, before any process group or model exists
    path, overrides = parse_args(argv)
    if "--check" in overrides:  # validate config, ranks, data and memory plan on any machine (runtime/preflight.py)
        from runtime.preflight import preflight
        return preflight(path, [a for a in overrides if a != "--check"],
                         lambda cfg: policies.load_preset(cfg.sched.preset, _sched_tables(cfg), _param_builder(cfg)))
    try:
        cfg = load_config(path, overrides)
        preset = policies.load_preset(cfg.sched.preset, _sched_tables(cfg), _param_builder(cfg))
        c = cfg.cluster
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        train_ranks, _ = split_ranks(world, c.rollout_ranks, c.rollout_fraction, c.colocate)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    # 2. the model, data and reward (each rank builds what its role needs): bad files fail here, in one line
    try:
        parts = build_run(cfg, with_data=rank == 0)
        model = model_for_rank(cfg, parts, device_for_rank(c.backend), rank in train_ranks)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from runtime.launch import prepare_run_dir, restart_count
    if restart_count() > 0 and not (cfg.log.dir or cfg.checkpoint.dir) and rank == 0:
        print("warning: restarted by torchrun without log.dir: a new run directory, starting afresh",
              file=sys.stderr, flush=True)

    # 3. ranks and process groups; one run directory, named on rank 0
    topo = init_distributed(c.rollout_ranks, c.rollout_fraction, c.colocate, c.backend, c.timeout_s)
    if c.cpu_affinity == "partition":
        local, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        node_ranks = list(range(topo.rank - local, topo.rank - local + local_world))
        train_cores, rollout_cores = partition_cores(sorted(os.sched_getaffinity(0)), node_ranks, topo)
        pin_to_cores(rollout_cores if topo.is_rollout else train_cores)
    if topo.device.type == "cpu":
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(c.cpu_threads or max(1, (os.cpu_count() or 1) // local_ranks))
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    # a job torchrun restarted (--max-restarts) resumes from its run directory's newest complete checkpoint
    holder = [prepare_run_dir(cfg, make_run_dir) if topo.is_leader else None]
    dist.broadcast_object_list(holder, src=0, group=topo.control_group)
    run_dir, t0 = holder[0]
    watchdog.install(run_dir, topo.rank)
    channel = Channel(topo.control_group, topo.rank, c.timeout_s)

    # 4. roles; a deadline that fires anywhere ends the job with a stall report (runtime/watchdog.py)
    try:
        run_role(cfg, preset, parts, model, topo, channel, run_dir, t0)
    except Exception as e:
        if watchdog.is_timeout(e):
            role = "leader" if topo.is_leader else "rollout" if topo.is_rollout else "train"
            watchdog.report_stall(run_dir, topo.rank, e, f"running as a {role} rank")
        raise

    # 5. orderly shutdown: every rank stops its neighbour's inbox, then leaves
    dist.barrier(group=topo.control_group)
    channel.close(stop_peer=(topo.rank + 1) % topo.world)
    dist.destroy_process_group()
    watchdog.uninstall()
    return 0


def run_role(cfg, preset, parts, model, topo, channel, run_dir: str, t0: float) -> None:
    log = controller = None
    if topo.is_leader:
        log = MetricsLogger(cfg, run_dir, num_engines=len(topo.rollout_ranks))
        controller = Controller(preset, parts.source, cfg.rollout.group_size, cfg.rollout.prompts_per_step,
                                cfg.train.steps, log=log)
    if topo.colocate:
        from runtime.launch import run_colocated
        run_colocated(cfg, parts, model, topo, channel, controller, log, run_dir, t0)
    elif topo.is_rollout:
        from runtime.launch import run_rollout
        run_rollout(cfg, parts, model, topo, channel, t0)
    elif not topo.is_leader:
        from runtime.launch import run_follower
        run_follower(cfg, parts, model, topo)
    else:
        from runtime.launch import run_leader
        run_leader(cfg, parts, model, topo, channel, controller, log, run_dir, t0)


def _sched_tables(cfg) -> dict:
    s = cfg.sched
    return {k: getattr(s, k) for k in ("dispatch", "handoff", "update", "weight_sync", "rebalance")}


def _param_builder(cfg):
    src = f"configs/sched/{cfg.sched.preset}.toml"
    return lambda cls, table, prefix: build(cls, table, src, prefix, key_sources=cfg.sources)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

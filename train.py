"""GRPO with verifiable rewards: a rollout partition of decode engines and an FSDP2 train partition, scheduled by
pluggable policies (sched/). One entry point for every rank.

    # the tiny offline default (random tiny model, synthetic task): 1 rollout rank + 3 train ranks on CPU
    torchrun --nproc_per_node=4 train.py --config configs/tiny.toml
    # any key can be overridden from the command line; `python train.py --help` lists them all
    torchrun --nproc_per_node=4 train.py --config configs/tiny.toml --train.steps=20 --sched.preset=sync
    # a budget in trained samples, the same under every preset (`train.steps` counts the preset's own steps)
    torchrun --nproc_per_node=4 train.py --config configs/tiny.toml --sched.preset=rolloutpipe --train.samples=38400
    # one mechanism of the preset replaced (and a parameter of it set)
    torchrun --nproc_per_node=4 train.py --config configs/tiny.toml --sched.dispatch=fewest_tokens \
        --sched.dispatch.max_groups_per_call=4
    # check a config on any machine (no GPU, no weights): rank plan, data, memory plan for the target GPU
    python train.py --config configs/qwen3-1.7b-math-8gpu.toml --check
    # one GPU: engine and trainer share the device (colocated)
    torchrun --nproc_per_node=1 train.py --config configs/X.toml --cluster.colocate=true
    # two nodes of 8: run this on each node, with the same rendezvous endpoint
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 train.py --config C

What each rank does is one of the four functions below: `run_leader` (global rank 0: the controller in the main
thread, the trainer in a second one), `run_follower` (the other train ranks), `run_rollout` (one engine per rollout
rank) and `run_colocated` (every rank both, taking turns). Everything a run writes goes to its run directory
(runtime/rundir.py): config.toml, events.jsonl, metrics.jsonl, timeline.png, checkpoints/ and the exported model
in hf/ with the run's tokenizer.
"""
from __future__ import annotations

import copy
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable

gc.disable()   # start-up makes ~300k long-lived objects (imports, model, data): no collection passes over them
#                (5 full passes, ~0.4 s); step 4 freezes them out of every later scan and turns the collector on
if __name__ == "__main__":   # the launch's first line, before the imports below (seconds of them on a busy machine)
    from runtime.progress import starting
    starting(sys.argv[1:])

import torch
import torch.distributed as dist

import cpu
import sched
from config import Config, ConfigError, describe, load_config
from runtime import faults, preempt, watchdog
from runtime.backend import RuntimeBackend
from runtime.budget import resolve as resolve_budget
from runtime.build import (RunParts, build_run, deterministic_algorithms, device_for_rank, import_train_side,
                           make_engine, make_trainer, model_dtype, model_for_rank, relay_chain)
from runtime.channel import Channel
from runtime.logger import MetricsLogger
from runtime.messages import ExportHF, Publish, SaveCheckpoint
from runtime.preempt import Preempted, Preemption
from runtime.process_exit import leave
from runtime.progress import phase
from runtime.rollout_worker import RolloutWorker
from runtime.rundir import (checkpoint_dir, finish_run, leader_state, periodic_checkpoints, prepare_run_dir,
                            restart_count, restore, resume_path)
from runtime.topology import Topology, gpu_count, init_distributed, shared_devices, split_ranks
from runtime.watchdog import Phase, waiting
from sched.base import Preset
from sched.controller import Controller
from trainer.publish import WeightReceiver

if TYPE_CHECKING:
    from trainer.trainer import Trainer


USAGE = """\
usage: torchrun --nproc_per_node=N train.py [--config FILE] [--section.key=value ...]
       python train.py [--config FILE] [--section.key=value ...] --check
       python train.py --help

  --config FILE          a TOML run config (configs/*.toml): [section] tables of the keys below; a key it leaves out
                         takes its default
  --section.key=value    set one key, after the file, in order (--train.lr=1e-5 --log.dir=runs/x); the value is read
                         as TOML when it parses (1e-5, true, [0.9, 0.95], "x"), else as the bare text
  --sched.preset=NAME    the scheduling preset, configs/sched/NAME.toml (`python -m sched` lists the mechanisms)
  --sched.KIND=NAME      replace the preset's mechanism of one kind (dispatch, handoff, update, weight_sync,
  --sched.KIND.PARAM=V   rebalance), or set one of its parameters
  --check                check the config, rank plan, data and memory plan on any machine (no GPU), then exit
  --help, -h             this text

keys (--section.key=default  (type, allowed values)), then what each does:
"""


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


def default_off_policy(cfg: Config, preset: Preset) -> None:
    """Decoupled PPO (AReaL's, rl/loss.py) by default under a preset that lets trained tokens be stale (a staleness
    bound >= 1: staleflow, areal, verl_async, one_step, ...); `train.off_policy` set in the file or on the command
    line is kept as given."""
    if "train.off_policy" not in cfg.sources and (preset.staleness_bound() or 0) >= 1:
        cfg.train.off_policy = "decoupled"


FAIL_WAIT_S = 60.0   # under torchrun, how long a node's other ranks wait for its first rank to report a bad input


def fail(line: str, path: str | None, overrides: list[str]) -> int:
    """A bad input found before any process group exists: every rank finds the same one (config, data file, model
    files; only rank 0 reads the data rows) and returns exit code 2; the node's first rank alone prints it, as one
    line. Under torchrun the line names the `--check` command, which gives the same line in seconds, and goes into
    torchrun's error file, so that torchrun's failure report (printed after every rank exits) ends with it as its
    root cause.

    Under torchrun the node's other ranks wait (up to FAIL_WAIT_S) for torchrun to stop them once the first rank has
    exited: a rank that exited first would be torchrun's first failure, its report's root cause (timestamps in whole
    seconds, the earliest recorded failure winning a tie), and torchrun would stop the first rank, SIGTERM, before it
    printed the line when it reached the check later."""
    if int(os.environ.get("LOCAL_RANK", 0) or 0) != 0:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            time.sleep(FAIL_WAIT_S)
        return 2
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if "TORCHELASTIC_RUN_ID" in os.environ or error_file:
        line += f" (check it in seconds: {check_command(path, overrides)})"
    print(line, file=sys.stderr, flush=True)
    if error_file:
        try:
            Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
        except OSError:
            pass   # the line is printed; torchrun's report then shows its own text
    return 2


def check_command(path: str | None, overrides: list[str]) -> str:
    """`python train.py --config C [overrides] --check`, the arguments quoted for a shell."""
    import shlex
    args = (["--config", path] if path else []) + overrides + ["--check"]
    return "python train.py " + " ".join(shlex.quote(a) for a in args)


SHARED_GPU_FRACTION = 0.5   # a rule of thumb for an engine beside a trainer on one GPU (the warning in main)


def main(argv: list[str]) -> int:
    # 1. configuration: every mistake is reported here, before any process group or model exists
    path, overrides = parse_args(argv)
    if "--help" in overrides or "-h" in overrides:
        print(USAGE + "\n" + describe())
        return 0
    if "--check" in overrides:  # validate config, ranks, data and memory plan on any machine (runtime/preflight.py)
        from runtime.preflight import preflight
        return preflight(path, [a for a in overrides if a != "--check"])
    try:
        cfg = load_config(path, overrides)
        preset = sched.load_preset(cfg.sched.preset, cfg.sched.overrides(), cfg.sources)
        default_off_policy(cfg, preset)
        budget = resolve_budget(cfg, preset)
        budget.apply(cfg)
        c = cfg.cluster
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        train_ranks, rollout_ranks = split_ranks(world, c.rollout_ranks, c.rollout_fraction, c.colocate)
        shared = shared_devices(train_ranks, rollout_ranks, int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                                gpu_count(c.backend), c.colocate, cfg.perf.migrate_kv)
        resume_path(cfg)   # a named checkpoint that is not there fails here, on every rank
    except (ConfigError, ValueError, FileNotFoundError) as e:
        return fail(f"config error: {e}", path, overrides)
    if rank == 0:   # what the budget means under this preset (runtime/budget.py), always
        print(budget.line, flush=True)
    if shared and rank == 0 and cfg.rollout.gpu_memory_fraction > SHARED_GPU_FRACTION:
        node, dev, ranks = shared[0]
        print(f"warning: cuda:{dev} of node {node} holds train and rollout ranks {ranks} (and {len(shared) - 1} "
              f"more GPUs like it): its engine takes rollout.gpu_memory_fraction = "
              f"{cfg.rollout.gpu_memory_fraction} of the memory free when it starts, before the trainer's optimizer "
              f"state exists; <= {SHARED_GPU_FRACTION} leaves the trainer room", file=sys.stderr, flush=True)

    # 2. the model, data and reward (each rank builds what its role needs): bad files fail here, in one line
    try:
        parts = build_run(cfg, with_data=rank == 0, with_tokenizer=rank == 0 or rank in rollout_ranks)
        model = model_for_rank(cfg, parts, device_for_rank(c.backend), rank in train_ranks)
    except (OSError, ValueError) as e:
        return fail(f"error: {e}", path, overrides)
    if restart_count() > 0 and not (cfg.log.dir or cfg.checkpoint.dir) and rank == 0:
        print("warning: restarted by torchrun without log.dir: a new run directory, starting afresh",
              file=sys.stderr, flush=True)
    phase("model ready", rank, timed=True)

    if rank in train_ranks:   # before any deadline runs; a rollout rank never needs the train side
        import_train_side()

    # 3. ranks and process groups; one run directory, named on rank 0
    topo = init_distributed(c.rollout_ranks, c.rollout_fraction, c.colocate, c.backend, c.timeout_s,
                            kv_group=cfg.perf.migrate_kv)
    cpu.enable(cfg, topo)   # the C backend for CPU runs (cpu/), and this rank's cores, threads and allocator
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        deterministic_algorithms(True)
    # a job torchrun restarted (--max-restarts) resumes from its run directory's newest complete checkpoint
    holder = [prepare_run_dir(cfg) if topo.is_leader else None]
    dist.broadcast_object_list(holder, src=0)  # the default group: start-up waits (runtime/topology.py STARTUP_MIN_S)
    run_dir, t0 = holder[0]
    phase(f"{topo.world} ranks joined (" + ("colocated" if topo.colocate else f"{len(topo.train_ranks)} train, "
          f"{len(topo.rollout_ranks)} rollout") + f"): {run_dir}", topo.rank, timed=True)

    # 4. the rank's role. From here on every blocking call is a declared wait: a rank frozen, dead or without
    # progress for cluster.timeout_s ends the job with a stall report (runtime/watchdog.py)
    gc.freeze()   # start-up's objects leave the collector's scans: full passes over them took up to 0.27 s each,
    gc.enable()   # every ~30 steps of the tiny run (2 s of its 17); the run's own garbage is collected as usual
    watchdog.install(run_dir, topo.rank, topo.world, [topo.role(r) for r in range(topo.world)], topo.store,
                     c.timeout_s)
    faults.install(faults.Injector.from_env(topo.rank, topo.store))   # TIDAL_FAULTS: test fault injection
    # a preemption signal: every rank stops at the next safe point, after a checkpoint (runtime/preempt.py)
    preemption = preempt.install(c.preempt_signals, c.preempt_grace_s, topo.rank, topo.store, watchdog.gone_ranks)
    channel = Channel(topo.control_group, topo.rank)
    try:
        if topo.colocate:
            finish = run_colocated(cfg, preset, parts, model, topo, channel, run_dir, t0, preemption)
        elif topo.is_rollout:
            finish = run_rollout(cfg, preset, parts, model, topo, channel, t0)
        elif topo.is_leader:
            finish = run_leader(cfg, preset, parts, model, topo, channel, run_dir, t0, preemption)
        else:
            finish = run_follower(cfg, model, topo)
    except BaseException:  # leave at once (a thread blocked in a collective must not keep the process alive)
        preempt.await_deadline(preemption)   # unless it is the other ranks leaving at their preemption deadline
        watchdog.failed(traceback.format_exc())

    # 5. orderly shutdown: every rank stops its neighbour's inbox, then leaves; the leader writes the run summary
    phase("shutting down the ranks", topo.rank)
    with waiting("every rank to finish (the shutdown barrier)", on=range(topo.world)):
        dist.barrier(group=topo.control_group)
    preempted = preempt.seen(topo.store)   # the leader stopped early for a request: every rank knows it by now
    preempt.uninstall()                    # before the store goes; a preempted rank ignores the signals from here
    channel.close(stop_peer=(topo.rank + 1) % topo.world)
    dist.destroy_process_group()
    watchdog.uninstall()
    if preempted and topo.is_leader:   # no summary: the resumed run writes the whole run's
        print(preempt.resume_line(run_dir, checkpoint_latest(cfg, run_dir), argv, preempted), file=sys.stderr,
              flush=True)
    elif finish is not None:
        finish()
    if "triton" in sys.modules:   # imported by torch._dynamo on the train ranks: start-up froze its extension
        gc.unfreeze()              # objects' cycles, which then outlive the interpreter's last collection and
    #                            print a nanobind leak report at exit (costs the tiny job ~0.7 s of teardown)
    return preempt.PREEMPTED_EXIT_CODE if preempted else 0


def checkpoint_latest(cfg: Config, run_dir: str) -> str | None:
    """The newest complete checkpoint of the run, as a path string (what a preempted run resumes from)."""
    from trainer.checkpoint import latest
    path = latest(checkpoint_dir(cfg, run_dir))
    return str(path) if path is not None else None


def export_hf(call: Callable[[ExportHF], None], cfg: Config, parts: RunParts, run_dir: str) -> None:
    """RUN_DIR/hf: the final weights in the Hugging Face layout (the train ranks gather them, rank 0 writes), then the
    run's tokenizer and generation config beside them (model/tokenizer.py `export_tokenizer`)."""
    from model.tokenizer import export_tokenizer
    hf = Path(run_dir) / "hf"
    call(ExportHF(str(hf)))
    export_tokenizer(parts.tokenizer, hf, sources=(cfg.model.path, cfg.model.tokenizer))


def resume_trainer(cfg: Config, trainer: Trainer, topo: Topology) -> dict | None:
    """Load the checkpoint this attempt resumes from into the trainer (collective on the train ranks); its extra."""
    path = resume_path(cfg)
    if path is None:
        return None
    with waiting(f"the load of checkpoint {path}", on=topo.train_ranks, phase=Phase.CHECKPOINT):
        return trainer.load_checkpoint(path) or {}


# ----------------------------------------------------------------------------------------------------- roles
def run_leader(cfg: Config, preset: Preset, parts: RunParts, model: torch.nn.Module, topo: Topology,
               channel: Channel, run_dir: str, t0: float, preemption: Preemption | None = None
               ) -> Callable[[], None]:
    """Global rank 0: the controller drives the policies in this thread; the trainer runs its work items (and
    broadcasts the weights it publishes) in a second one, with the other train ranks following it. Returns the
    run summary's writer, called once every rank has left."""
    from runtime.train_worker import TrainerThread  # the train side (FSDP2, DCP): train ranks only import it
    log = MetricsLogger(cfg, run_dir, num_engines=len(topo.rollout_ranks))
    controller = Controller(preset, parts.source, cfg.rollout.group_size, cfg.rollout.prompts_per_step,
                            cfg.train.steps, log=log, total_samples=cfg.train.samples or None)
    trainer, publisher = make_trainer(cfg, model, topo)
    extra = resume_trainer(cfg, trainer, topo)
    if extra is not None:
        restore(controller, parts, extra)
        log.resumed(trainer.step)
    tt = TrainerThread(trainer, publisher, topo, channel, t0, notify=lambda v: backend.notify_publication(v))
    backend = RuntimeBackend(topo, channel, t0, to_trainer=tt.queue.put,
                             isolates_faults=preset.failures_isolated() > 0, kv_block_size=cfg.rollout.kv_block_size)

    def save() -> None:
        backend.call(SaveCheckpoint(str(checkpoint_dir(cfg, run_dir)), leader_state(controller, parts, log),
                                    cfg.checkpoint.keep))

    backend.to_trainer(Publish(trainer.step))   # the engines start from the trainer's weights
    try:
        with watchdog.doing("the controller's loop"):
            controller.run(backend, periodic_checkpoints(cfg, controller, save, preemption))
        log.end_bar()
        phase("saving the final checkpoint", timed=True)
        save()
        phase(f"exporting the model to {Path(run_dir) / 'hf'}", when=cfg.checkpoint.export_hf)
        if cfg.checkpoint.export_hf:
            export_hf(backend.call, cfg, parts, run_dir)
    except Preempted:   # saved at a safe point: the engines and train ranks stop as at the end, no export
        pass
    finally:
        backend.stop_workers()
        tt.stop()
        log.close()
    return lambda: finish_run(run_dir, log, parts, cfg.log.plots)


def run_follower(cfg: Config, model: torch.nn.Module, topo: Topology) -> None:
    """Train ranks 1..T-1: run each work item the leader broadcasts, collectively (FSDP2), until it says stop."""
    from runtime.train_worker import follower_loop
    trainer, publisher = make_trainer(cfg, model, topo)
    resume_trainer(cfg, trainer, topo)
    follower_loop(trainer, publisher, topo)


def run_rollout(cfg: Config, preset: Preset, parts: RunParts, model: torch.nn.Module, topo: Topology,
                channel: Channel, t0: float) -> None:
    """Rollout ranks: one decode engine each, driven by the leader's messages; published weights arrive in this
    rank's relay and are loaded when the weight-sync policy says."""
    engine = make_engine(cfg, model, parts, topo)
    receiver = WeightReceiver(topo.publish_group, src=0, device="cpu", progress=watchdog.progress,
                              chain=relay_chain(cfg, topo))
    RolloutWorker.for_rank(cfg, parts, engine, topo, channel, t0, receiver, preset=preset).run()


def run_colocated(cfg: Config, preset: Preset, parts: RunParts, model: torch.nn.Module, topo: Topology,
                  channel: Channel, run_dir: str, t0: float, preemption: Preemption | None = None
                  ) -> Callable[[], None] | None:
    """Every rank: an engine on a private copy of the weights plus an FSDP2 trainer shard, taking turns; rank 0 also
    runs the controller, in a thread (runtime/colocated.py), and returns the run summary's writer."""
    from runtime.colocated import ColocatedBackend, ColocatedWorker, ControllerThread
    engine = make_engine(cfg, copy.deepcopy(model).to(model_dtype(cfg, topo.device)), parts, topo)
    trainer, _ = make_trainer(cfg, model, topo)
    extra = resume_trainer(cfg, trainer, topo)
    worker = ColocatedWorker.for_rank(cfg, parts, engine, topo, channel, t0, None, trainer=trainer,
                                      ranks=topo.train_ranks, preset=preset, keep_kv=preset.weight_sync.keeps_kv)
    ctl = log = None
    if topo.is_leader:
        log = MetricsLogger(cfg, run_dir, num_engines=len(topo.rollout_ranks))
        controller = Controller(preset, parts.source, cfg.rollout.group_size, cfg.rollout.prompts_per_step,
                                cfg.train.steps, log=log, total_samples=cfg.train.samples or None)
        if extra is not None:
            restore(controller, parts, extra)
            log.resumed(trainer.step)
        backend = ColocatedBackend(topo, channel, t0)

        def save() -> None:
            backend.call(SaveCheckpoint(str(checkpoint_dir(cfg, run_dir)), leader_state(controller, parts, log),
                                        cfg.checkpoint.keep))

        def finish() -> None:
            log.end_bar()
            phase("saving the final checkpoint", timed=True)
            save()
            phase(f"exporting the model to {Path(run_dir) / 'hf'}", when=cfg.checkpoint.export_hf)
            if cfg.checkpoint.export_hf:
                export_hf(backend.call, cfg, parts, run_dir)
        ctl = ControllerThread(controller, backend, finish, periodic_checkpoints(cfg, controller, save, preemption))
    worker.start()
    worker.run()
    if ctl is None:
        return None
    ctl.join()
    log.close()
    return lambda: finish_run(run_dir, log, parts, cfg.log.plots)


if __name__ == "__main__":   # main has returned: the run's files are closed; no interpreter teardown
    leave(main(sys.argv[1:]))   # (runtime/process_exit.py: ~0.5 s of CPU a rank at the end of every launch)

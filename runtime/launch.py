"""What each role does for the whole run: the leader (controller + trainer thread), the other train ranks, and
the rollout ranks. train.py picks one per rank."""
from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from runtime.backend import RuntimeBackend
from runtime.build import RunParts, model_dtype, reward_scorer
from runtime.channel import WORKER, Channel
from runtime.logger import MetricsLogger
from runtime.rollout_worker import RolloutWorker, SamplingConfig
from runtime.topology import Topology
from runtime.train_worker import TrainerThread, follower_loop
from sched.controller import Controller
from sched.events import Event
from trainer import checkpoint
from trainer.publish import WeightPublisher, WeightReceiver
from trainer.trainer import Trainer


def make_trainer(cfg: Any, model: torch.nn.Module, topo: Topology) -> tuple[Trainer, WeightPublisher | None]:
    ref = copy.deepcopy(model) if cfg.train.kl_coef > 0 else None
    trainer = Trainer(model, cfg.train, group=topo.train_group, device=topo.device, ref_model=ref,
                      temperature=cfg.rollout.temperature or 1.0, max_response_len=cfg.rollout.max_new_tokens)
    if topo.colocate:
        return trainer, None
    publisher = WeightPublisher(trainer.model, topo.publish_group, topo.train_group,
                                dtype=model_dtype(cfg, topo.device), verify=cfg.cluster.verify_weights)
    return trainer, publisher


def make_engine(cfg: Any, model: torch.nn.Module, parts: RunParts, topo: Topology) -> LLMEngine:
    r = cfg.rollout
    on_gpu = topo.device.type == "cuda"
    return LLMEngine(model, EngineConfig(
        block_size=r.kv_block_size, num_kv_tokens=None if on_gpu else r.kv_cache_tokens,
        memory_fraction=r.gpu_memory_fraction, max_num_seqs=r.max_num_seqs, max_batch_tokens=r.max_batch_tokens,
        cuda_graphs=r.cuda_graphs, seed=cfg.seed), tokenizer=parts.tokenizer, version=-1)


def worker_args(cfg: Any, parts: RunParts, engine: LLMEngine, topo: Topology, channel: Channel, t0: float,
                receiver: WeightReceiver | None) -> tuple:
    r = cfg.rollout
    return (engine, channel, topo.engine_of(topo.rank), topo.rank, parts.reward_fn,
            response_decoder(parts.tokenizer, engine.eos_ids), receiver,
            SamplingConfig(r.temperature, r.top_p, r.top_k, r.max_new_tokens, cfg.seed), t0, cfg.cluster.timeout_s,
            cfg.cluster.verify_weights, reward_scorer(cfg, parts.reward_fn))


def run_follower(cfg: Any, parts: RunParts, model: torch.nn.Module, topo: Topology) -> None:
    trainer, publisher = make_trainer(cfg, model, topo)
    resume = resume_path(cfg)
    if resume is not None:
        trainer.load_checkpoint(resume)
    follower_loop(trainer, publisher, topo)


def run_rollout(cfg: Any, parts: RunParts, model: torch.nn.Module, topo: Topology, channel: Channel,
                t0: float) -> None:
    engine = make_engine(cfg, model, parts, topo)
    receiver = WeightReceiver(topo.publish_group, src=0, device="cpu")
    RolloutWorker(*worker_args(cfg, parts, engine, topo, channel, t0, receiver)).run()


def run_colocated(cfg: Any, parts: RunParts, model: torch.nn.Module, topo: Topology, channel: Channel,
                  controller: Controller | None, log: MetricsLogger | None, run_dir: str, t0: float) -> None:
    """Every rank: an engine on a private copy of the weights plus an FSDP2 trainer shard; rank 0 also runs the
    controller in a thread (runtime/colocated.py)."""
    from runtime.colocated import ColocatedBackend, ColocatedWorker, ControllerThread
    engine = make_engine(cfg, copy.deepcopy(model).to(model_dtype(cfg, topo.device)), parts, topo)
    trainer, _ = make_trainer(cfg, model, topo)
    resume = resume_path(cfg)
    extra = (trainer.load_checkpoint(resume) or {}) if resume is not None else None
    worker = ColocatedWorker(*worker_args(cfg, parts, engine, topo, channel, t0, None), trainer=trainer)
    ctl = None
    if topo.is_leader:
        if extra is not None:
            restore(controller, parts, extra)
        backend = ColocatedBackend(topo, channel, None, t0, cfg.cluster.timeout_s)

        def save() -> None:
            backend.call(("checkpoint", str(checkpoint_dir(cfg, run_dir)), leader_state(controller, parts),
                          cfg.checkpoint.keep))

        def finish(b: ColocatedBackend) -> None:
            save()
            if cfg.checkpoint.export_hf:
                b.call(("export", str(Path(run_dir) / "hf")))
        ctl = ControllerThread(controller, backend, finish, periodic_checkpoints(cfg, controller, save))
    worker.start()
    worker.run()
    if ctl is not None:
        ctl.join(cfg.cluster.timeout_s)
        log.close()
        finish_run(run_dir, log, parts)


def response_decoder(tok: Any, eos_ids: frozenset[int]):
    """Text the reward sees: the final EOS dropped, every other special token kept, so a policy cannot earn reward
    by padding with special tokens that a skip-special-tokens decode would hide."""
    def decode(ids: list[int]) -> str:
        return tok.decode(ids[:-1] if ids and ids[-1] in eos_ids else ids, skip_special_tokens=False)
    return decode


def restart_count() -> int:
    """How many times torchrun has restarted this job (0: the first attempt; `--max-restarts` allows more)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def checkpoint_dir(cfg: Any, run_dir: str | Path | None = None) -> Path:
    """`checkpoint.dir`, or RUN_DIR/checkpoints."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir or cfg.log.dir) / "checkpoints"


def resume_path(cfg: Any) -> Path | None:
    """The checkpoint this attempt starts from, or None for a fresh start. Every rank calls it and gets the same
    answer. A job that torchrun restarted (`--max-restarts`) resumes from the newest complete checkpoint of its run
    directory on its own, when it has one (the run directory must be stable: set log.dir or checkpoint.dir)."""
    if not cfg.checkpoint.resume:
        if restart_count() > 0 and (cfg.log.dir or cfg.checkpoint.dir):
            return checkpoint.latest(checkpoint_dir(cfg))
        return None
    if cfg.checkpoint.resume == "latest":
        if not cfg.log.dir and not cfg.checkpoint.dir:
            raise ValueError("checkpoint.resume = 'latest' needs log.dir (the run directory to resume)")
        path = checkpoint.latest(checkpoint_dir(cfg))
        if path is None:
            if restart_count() > 0:  # restarted before this attempt's first checkpoint: start afresh
                return None
            raise FileNotFoundError(f"checkpoint.resume = 'latest': no complete checkpoint in {checkpoint_dir(cfg)}")
        return path
    path = Path(cfg.checkpoint.resume)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint.resume = {cfg.checkpoint.resume!r} is not a directory")
    return path


def run_leader(cfg: Any, parts: RunParts, model: torch.nn.Module, topo: Topology, channel: Channel,
               controller: Controller, log: MetricsLogger, run_dir: str, t0: float) -> None:
    trainer, publisher = make_trainer(cfg, model, topo)
    resume = resume_path(cfg)
    if resume is not None:
        restore(controller, parts, trainer.load_checkpoint(resume) or {})
    tt = TrainerThread(trainer, publisher, topo, channel, t0)
    backend = RuntimeBackend(topo, channel, tt.queue, t0, cfg.cluster.timeout_s)
    ckpt_dir = checkpoint_dir(cfg, run_dir)
    timeout = cfg.cluster.timeout_s

    def save() -> None:
        tt.call(("checkpoint", str(ckpt_dir), leader_state(controller, parts), cfg.checkpoint.keep), timeout)

    tt.queue.put(("publish", trainer.step))  # the engines start from the trainer's weights
    try:
        controller.run(backend, periodic_checkpoints(cfg, controller, save))
        save()
        if cfg.checkpoint.export_hf:
            tt.call(("export", str(Path(run_dir) / "hf")), timeout)
    finally:
        for r in topo.rollout_ranks:
            channel.send(("stop",), r, WORKER)
        tt.stop(timeout)
        log.close()
    finish_run(run_dir, log, parts)


def periodic_checkpoints(cfg: Any, controller: Controller, save: Callable[[], None]) -> Callable[[Event], None]:
    """The controller's after-event hook: every `checkpoint.every` published versions, `save()` at the first moment
    the trainer holds no work (nothing training, no gradients accumulated); trajectories in flight go into the
    controller's state (sched/snapshot.py). The final checkpoint is the caller's."""
    due = [False]

    def after_event(ev: Event) -> None:
        every = cfg.checkpoint.every
        if ev.kind == "version_published" and every and ev.version % every == 0 and 0 < ev.version < cfg.train.steps:
            due[0] = True
        t = controller.v.trainer
        if due[0] and not t.busy and t.groups_since_step == 0 and not controller.done:
            due[0] = False
            save()
    return after_event


def leader_state(controller: Controller, parts: RunParts) -> dict[str, Any]:
    """What a checkpoint holds beyond the trainer's state: the controller's counters, views (trajectories finished
    and in flight, sched/snapshot.py) and policy state, the data position, the RNG, and how far the run's logs
    reached (a resumed run cuts them back there, so they read as one run)."""
    return {"controller": controller.state_dict(), "data": parts.source.state_dict(), "rng": torch.get_rng_state(),
            "log": log_marks(controller)}


LOGS = ("events.jsonl", "metrics.jsonl")


def log_marks(controller: Controller) -> dict[str, Any]:
    """Byte lengths of the run's logs and the controller's clock, as of now (the logs are flushed first)."""
    log = controller.log
    marks: dict[str, Any] = {"t": controller.v.now}
    for name, f in zip(LOGS, (getattr(log, "_f", None), getattr(log, "metrics_f", None))):
        if f is not None and not f.closed:
            f.flush()
            marks[name] = f.tell()
    return marks


def prepare_run_dir(cfg: Any, make_run_dir: Any) -> tuple[str, float]:
    """Leader only, before any log is opened: the run directory and the run's clock origin t0. A resumed run
    (or a restarted one) cuts its logs back to where its checkpoint left them — what came after is moved to
    events.discarded.jsonl / metrics.discarded.jsonl — and continues the checkpoint's clock."""
    run_dir = make_run_dir(cfg)
    now = time.time()
    path = resume_path(cfg)
    if path is None and restart_count() == 0:
        return run_dir, now
    marks = checkpoint.read_extra(path).get("extra", {}).get("log", {}) if path is not None else {"t": 0.0}
    for name in LOGS:
        rewind_log(Path(run_dir) / name, int(marks.get(name, 0)))
    print(f"restart {restart_count()}: " + (f"resuming from {path}" if path is not None else
          "no complete checkpoint yet, starting afresh"), file=sys.stderr, flush=True)
    return run_dir, now - float(marks.get("t", 0.0))


def rewind_log(path: Path, size: int) -> None:
    """Truncate `path` to `size` bytes, appending the cut tail to NAME.discarded.jsonl."""
    if not path.is_file() or path.stat().st_size <= size:
        return
    with open(path, "rb") as f:
        f.seek(size)
        tail = f.read()
    with open(path.with_suffix(".discarded.jsonl"), "ab") as out:
        out.write(tail)
    with open(path, "r+b") as f:
        f.truncate(size)


def restore(controller: Controller, parts: RunParts, extra: dict[str, Any]) -> None:
    controller.load_state_dict(extra["controller"])
    parts.source.load_state_dict(extra["data"])
    torch.set_rng_state(extra["rng"])


def fault_counts(events: list[Event]) -> dict[str, int]:
    """Isolated faults the run went on through, from its event log: scores whose reward function failed (raised
    or timed out; they scored 0) and samples dropped because their logits went non-finite."""
    return {"reward_failed": sum(1 for e in events if e.kind == "reward_scored" and e.data.get("failed")),
            "sample_errors": sum(1 for e in events if e.kind == "trajectory_aborted" and e.data.get("error"))}


def finish_run(run_dir: str, log: MetricsLogger, parts: RunParts) -> None:
    """summary.json and timeline.png, both from the event log."""
    from sched.events import read_events
    from sched.metrics import summarize
    from sched.timeline import draw
    events = list(read_events(Path(run_dir) / "events.jsonl"))
    summary = summarize(events)
    hist = log.history
    if hist:
        k = max(1, len(hist) // 4)
        summary["reward_first"] = sum(h.get("reward_mean", 0) for h in hist[:k]) / k
        summary["reward_last"] = sum(h.get("reward_mean", 0) for h in hist[-k:]) / k
    summary.update(fault_counts(events))
    summary["skipped_prompts"] = parts.skipped_prompts
    (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    draw(events, Path(run_dir) / "timeline.png", Path(run_dir).name)
    print(f"run directory: {run_dir}  reward {summary.get('reward_first', 0):.3f} -> "
          f"{summary.get('reward_last', 0):.3f}  ({summary['makespan_s']:.1f}s)")

"""Split the torchrun world into a train partition and a rollout partition, and make the process groups.

    global rank 0 .. T-1     train ranks (FSDP2 over `train_group`); rank 0 is the train leader and the controller
    global rank T .. W-1     rollout ranks, one decode engine each
    publish_group            train leader + every rollout rank (weights, in host memory: gloo; trainer/publish.py)
    kv_group                 the rollout ranks, when there are two or more: a migrated request's KV
                             (runtime/kv_transfer.py; NCCL on GPU, gloo on CPU)
    control_group            every rank, gloo, for the control channel (requests, trajectories, events)
    work_group               train ranks, gloo: the leader hands each work item to the followers through it
    store                    torchrun's key-value store (this attempt's keys): the watchdog's heartbeats

Only start-up waits on the process groups' own timeout (`cluster.timeout_s`: the rendezvous of every rank). After
it, the groups' timeouts are off (NO_PG_TIMEOUT): a gloo or NCCL call cannot tell a slow peer from a dead one, so
every blocking call is declared to runtime/watchdog.py instead, whose deadlines are renewed by progress.

The train leader is global rank 0 on purpose: torch.distributed.checkpoint's full-state-dict helpers gather to
global rank 0 (with cpu_offload=True; every other rank gets an empty dict). In colocated mode every rank is both a
train and a rollout rank and the engine shares the trainer's weights in place, so there is no publish group.

Devices: a rank takes cuda:(LOCAL_RANK mod the node's GPUs), so a node with fewer GPUs than ranks shares them between
the partitions (a trainer and an engine on one GPU: a small model, or a one-GPU test of the disaggregated runtime;
`rollout.gpu_memory_fraction` then bounds the engine's share), but never between two ranks of one NCCL group (the
train group, the KV group): `shared_devices` refuses such a split before any group exists, naming the ranks
(train.py asks it while it reads the config). The NCCL that torch 2.11 ships (2.28) refuses two ranks of one
communicator on one GPU ("Duplicate GPU detected"). With `perf.migrate_kv` off there is no KV group, so several
engines may share a GPU (a relay chain on one GPU).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


NO_PG_TIMEOUT = timedelta(days=30)   # the process groups' own timeout after start-up: off (module docstring)
# Start-up waits (rendezvous, process-group creation, the run directory's broadcast, the watchdog's first barrier)
# last at least this long whatever cluster.timeout_s says: ranks of different roles import and build different things
# (a rollout rank skips the train side: FSDP2, DCP, torch's compiler), so on a loaded CPU they arrive seconds apart,
# and a deadline of a few seconds meant for progress would fire on arrival order.
STARTUP_MIN_S = 60.0


@dataclass
class Topology:
    rank: int
    world: int
    train_ranks: list[int]
    rollout_ranks: list[int]
    colocate: bool
    device: torch.device
    train_group: dist.ProcessGroup | None = None
    publish_group: dist.ProcessGroup | None = None
    kv_group: dist.ProcessGroup | None = None
    control_group: dist.ProcessGroup | None = None
    work_group: dist.ProcessGroup | None = None
    mesh: object | None = field(default=None, repr=False)  # DeviceMesh over train_group (train ranks only)
    store: dist.Store | None = field(default=None, repr=False)

    @property
    def is_train(self) -> bool:
        return self.rank in self.train_ranks

    @property
    def is_rollout(self) -> bool:
        return self.rank in self.rollout_ranks

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def engine_rank(self, engine: int) -> int:
        return self.rollout_ranks[engine]

    def engine_of(self, rank: int) -> int:
        return self.rollout_ranks.index(rank)

    def role(self, rank: int) -> str:
        """What rank `rank` is, in words (stall reports)."""
        if self.colocate:
            return "colocated, controller" if rank == 0 else "colocated"
        if rank in self.rollout_ranks:
            return f"rollout, engine {self.engine_of(rank)}"
        return "train leader, controller" if rank == 0 else "train"


def split_ranks(world: int, rollout_ranks: int, rollout_fraction: float, colocate: bool) -> tuple[list[int], list[int]]:
    """(train ranks, rollout ranks). Raises ValueError naming the config keys when the split is impossible."""
    if colocate:
        return list(range(world)), list(range(world))
    if world < 2:
        raise ValueError(f"a disaggregated run needs at least 2 ranks (got a world of {world}); launch with "
                         f"torchrun --nproc_per_node>=2, or set cluster.colocate = true")
    n = rollout_ranks if rollout_ranks > 0 else round(world * rollout_fraction)
    n = max(1, min(world - 1, n)) if rollout_ranks == 0 else n
    if not 1 <= n <= world - 1:
        raise ValueError(f"cluster.rollout_ranks = {rollout_ranks} leaves no ranks for the other partition in a "
                         f"world of {world}; allowed: 1..{world - 1}")
    return list(range(world - n)), list(range(world - n, world))


def gpu_count(backend: str) -> int:
    """The GPUs this node's ranks run on: none with cluster.backend = "gloo" or without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() and backend != "gloo" else 0


def local_device(local_rank: int, gpus: int) -> torch.device:
    """A rank's device: cuda:(local_rank mod gpus), or the CPU without GPUs."""
    return torch.device("cuda", local_rank % gpus) if gpus > 0 else torch.device("cpu")


def shared_devices(train: list[int], rollout: list[int], local_world: int, gpus: int, colocate: bool,
                   migrate_kv: bool = True) -> list[tuple[int, int, list[int]]]:
    """The GPUs a train rank and a rollout rank share, as (node, device index, ranks); raises ValueError if two
    ranks of one NCCL group (the train ranks; the rollout ranks, which move KV to each other) would share one. Global
    rank r runs on node r // local_world (torchrun's contiguous numbering) as local rank r % local_world.
    migrate_kv=False (perf.migrate_kv): the rollout ranks form no KV group (init_distributed(kv_group=False)), so
    several may share a GPU; their only link is the weights' publication, host memory over gloo."""
    if gpus <= 0:
        return []

    def place(r: int) -> tuple[int, int]:
        return r // local_world, local_device(r % local_world, gpus).index
    groups = [("train", train)] + ([] if colocate or len(rollout) < 2 or not migrate_kv else [("rollout", rollout)])
    for name, ranks in groups:
        seen: dict[tuple[int, int], int] = {}
        for r in ranks:
            node, dev = place(r)
            if (node, dev) in seen:
                raise ValueError(f"{name} ranks {seen[node, dev]} and {r} would share cuda:{dev} of node {node} "
                                 f"({local_world} ranks a node on {gpus} GPUs): NCCL cannot run two ranks of one "
                                 f"group on one GPU. Launch at most {gpus} {name} ranks a node (cluster.rollout_ranks "
                                 f"sets the split), or more GPUs")
            seen[node, dev] = r
    if colocate:
        return []
    on: dict[tuple[int, int], list[int]] = {}
    for r in sorted(train + rollout):
        on.setdefault(place(r), []).append(r)
    return [(node, dev, ranks) for (node, dev), ranks in on.items()
            if any(r in train for r in ranks) and any(r in rollout for r in ranks)]


def init_distributed(rollout_ranks: int = 0, rollout_fraction: float = 0.5, colocate: bool = False,
                     backend: str = "auto", timeout_s: float = 300.0, kv_group: bool = True) -> Topology:
    """Initialise torch.distributed from torchrun's environment (or a world of one without it). kv_group=False
    (perf.migrate_kv off): no group over the rollout ranks, whose NCCL communicator would refuse two of them on one
    GPU."""
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29555"))
    gpus = gpu_count(backend)
    device = local_device(int(os.environ.get("LOCAL_RANK", 0)), gpus)
    if gpus:
        torch.cuda.set_device(device)
    pg_backend = "cpu:gloo,cuda:nccl" if gpus else "gloo"
    timeout = timedelta(seconds=max(timeout_s, STARTUP_MIN_S))   # the default group serves start-up only
    # a job torchrun restarted (--max-restarts) gets its own keys: the store still holds the dead attempt's
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"attempt{attempt}/", store)
    dist.init_process_group(pg_backend, store=store, rank=rank, world_size=world, timeout=timeout)
    train, rollout = split_ranks(world, rollout_ranks, rollout_fraction, colocate)   # devices: train.py's check
    topo = Topology(rank, world, train, rollout, colocate, device, store=store)
    # every rank creates every group, in the same order
    topo.control_group = dist.new_group(list(range(world)), backend="gloo", timeout=NO_PG_TIMEOUT)
    train_group = dist.new_group(train, backend=pg_backend, timeout=NO_PG_TIMEOUT)
    work_group = dist.new_group(train, backend="gloo", timeout=NO_PG_TIMEOUT)
    publish_group = None if colocate else dist.new_group([0] + rollout, backend=pg_backend, timeout=NO_PG_TIMEOUT)
    kv = (dist.new_group(rollout, backend=pg_backend, timeout=NO_PG_TIMEOUT) if kv_group and len(rollout) > 1
          else None)
    if topo.is_train:
        topo.train_group, topo.work_group = train_group, work_group
        from torch.distributed.device_mesh import DeviceMesh
        topo.mesh = DeviceMesh.from_group(train_group, device.type)
    if rank == 0 or topo.is_rollout:
        topo.publish_group = publish_group
    if topo.is_rollout:
        topo.kv_group = kv
    return topo


def partition_cores(cores: list[int], node_ranks: list[int], topo: Topology) -> tuple[list[int], list[int]]:
    """(train cores, rollout cores) of this node under perf.cpu_affinity = "partition": the node's rollout
    ranks get a share of `cores` (its usable CPUs) in proportion to their count, rounded, at least one core, the
    last ones; its train ranks the rest, so the two partitions never compete for a core, as on separate devices.
    A node holding one partition only gives it every core."""
    if topo.colocate:
        raise ValueError("perf.cpu_affinity = 'partition' needs separate partitions; colocated ranks run both")
    n_roll = sum(r in topo.rollout_ranks for r in node_ranks)
    n_train = len(node_ranks) - n_roll
    if n_roll == 0 or n_train == 0:
        return cores, cores
    if len(cores) < 2:
        raise ValueError(f"perf.cpu_affinity = 'partition' needs at least 2 CPUs on a node holding both "
                         f"partitions; this one has {len(cores)}")
    k = max(1, min(len(cores) - 1, round(len(cores) * n_roll / len(node_ranks))))
    return cores[:len(cores) - k], cores[len(cores) - k:]


def pin_to_cores(cores: list[int]) -> None:
    """Pin every thread of this process (gloo's included) to `cores`; threads started later inherit it."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            pass

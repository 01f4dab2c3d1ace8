"""The control channel over gloo: ordered delivery, any-source fan-in, deadlines that name the peer."""
import pytest

import torch

from runtime.topology import Topology, partition_cores, pin_to_cores, split_ranks
from tests.support.dist_utils import new_group, run_world


def _exchange(rank, world):
    from runtime.channel import Channel, ChannelTimeout
    import torch.distributed as dist
    ch = Channel(new_group(list(range(world))), rank)
    n = 50
    if rank == 0:
        got = {}
        for _ in range((world - 1) * n):
            src, obj = ch.get(waiting_for="workers")
            got.setdefault(src, []).append(obj["i"])
        ch.post({"local": True})
        local = ch.get()
        try:
            ch.get(timeout=0.2, waiting_for="rank 1's reply")
            timed_out = None
        except ChannelTimeout as e:
            timed_out = str(e)
        result = (got, local, timed_out)
    else:
        for i in range(n):
            ch.send({"i": i, "payload": list(range(i))}, 0)
        result = ch.messages_sent
    dist.barrier()
    ch.close(stop_peer=(rank + 1) % world)
    return result


def test_fan_in_is_complete_and_ordered_per_sender():
    results = run_world(_exchange, 3, deadline_s=120)
    got, local, timed_out = results[0]
    assert sorted(got) == [1, 2]
    assert all(got[s] == list(range(50)) for s in got)   # per-sender FIFO
    assert local == (0, {"local": True})
    assert "rank 1's reply" in timed_out and "rank 0" in timed_out
    assert results[1] == results[2] == 50


@pytest.mark.parametrize("world, n, frac, coloc, train, rollout", [
    (4, 1, 0.5, False, [0, 1, 2], [3]),
    (4, 0, 0.5, False, [0, 1], [2, 3]),
    (3, 0, 0.9, False, [0], [1, 2]),
    (2, 0, 0.5, True, [0, 1], [0, 1]),
])
def test_rank_split(world, n, frac, coloc, train, rollout):
    assert split_ranks(world, n, frac, coloc) == (train, rollout)


@pytest.mark.parametrize("world, n, msg", [(1, 0, "at least 2 ranks"), (3, 3, "allowed: 1..2")])
def test_impossible_splits_name_the_key(world, n, msg):
    with pytest.raises(ValueError, match=msg):
        split_ranks(world, n, 0.5, False)


def _topo(rank: int, world: int, n_rollout: int, colocate: bool = False) -> Topology:
    train, rollout = split_ranks(world, n_rollout, 0.5, colocate)
    return Topology(rank, world, train, rollout, colocate, torch.device("cpu"))


@pytest.mark.parametrize("cores, world, n_rollout, train_cores, rollout_cores", [
    ([0, 1], 4, 2, [0], [1]),               # the bench: 2 train + 2 rollout ranks on 2 cores
    ([0, 1], 4, 1, [0], [1]),               # the tiny default: at least one core each
    ([0, 1, 2, 3], 4, 1, [0, 1, 2], [3]),
    ([4, 5, 6, 7, 8, 9], 3, 1, [4, 5, 6, 7], [8, 9]),
])
def test_partition_cores_split_the_node(cores, world, n_rollout, train_cores, rollout_cores):
    for rank in range(world):
        topo = _topo(rank, world, n_rollout)
        assert partition_cores(cores, list(range(world)), topo) == (train_cores, rollout_cores)


def test_partition_cores_edge_cases():
    assert partition_cores([0, 1, 2], [0, 1], _topo(0, 4, 2)) == ([0, 1, 2], [0, 1, 2])  # node with train ranks only
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        partition_cores([0], [0, 1, 2, 3], _topo(0, 4, 2))
    with pytest.raises(ValueError, match="colocated"):
        partition_cores([0, 1], [0, 1], _topo(0, 2, 0, colocate=True))


def test_pinning_moves_every_thread(tmp_path):
    import os
    import threading
    before = os.sched_getaffinity(0)
    started, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (started.set(), stop.wait()), daemon=True)
    t.start()
    started.wait()
    target = [min(before)]
    try:
        pin_to_cores(target)
        assert os.sched_getaffinity(0) == set(target) and os.sched_getaffinity(t.native_id) == set(target)
    finally:
        stop.set()
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), before)

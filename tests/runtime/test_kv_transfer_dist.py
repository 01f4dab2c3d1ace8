"""A request's KV between two gloo ranks (runtime/kv_transfer.py): rank 0's engine exports it, its KVSender sends
it, rank 1's KVReceiver receives it on its thread, its engine decodes on without a prefill and finishes exactly as
an uninterrupted run (a request whose KV is no longer kept goes as "no KV"); the workers' side of it is in
tests/runtime/test_kv_migration.py. And a receiver whose sender never sends ends with the watchdog's named report
(runtime/watchdog.py), not a hang."""
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support import dist_utils

pytestmark = [pytest.mark.dist, pytest.mark.slow]

REQ = 7


def _move(rank: int, world: int):
    """Rank 0's engine runs the request, exports it with its KV, sends the KV (and, as the controller would, the
    rest of the request); rank 1's engine imports and finishes it. Rank 0 then runs it uninterrupted for reference."""
    from engine import GenRequest, SamplingParams
    from runtime.kv_transfer import KVReceiver, KVSender
    from tests.runtime.test_kv_migration import tiny_model
    from tests.support.engine import engine, prompts
    group = dist.new_group([0, 1], backend="gloo")
    model = tiny_model()   # the same weights on both ranks (seeded init)
    outs = {}
    for temperature in (0.0, 1.0):
        req = GenRequest(prompts((11,))[0], SamplingParams(temperature=temperature, max_new_tokens=10, seed=3),
                         request_id=REQ)
        box: list = [None]
        if rank == 0:
            src = engine(model)
            src.add_request(req)
            for _ in range(4):
                src.step()
            u = src.export(REQ, with_kv=True)
            sender = KVSender(group)
            sender.send(u.kv, REQ, 1)
            sender.send(None, 99, 1)   # a request whose KV is no longer kept: "no KV"
            u.kv, box = None, [u]
            dist.broadcast_object_list(box, src=0)
            sender.close()
            outs[temperature] = engine(model).generate([req])[0]
            continue
        dist.broadcast_object_list(box, src=0)
        u = box[0]
        receiver = KVReceiver(group, torch.device("cpu"))   # the receiving thread, as a rollout worker runs it
        receiver.receive(REQ, 0)
        receiver.receive(99, 0)
        got = dict(receiver.wait_all())
        receiver.close()
        assert got[99] is None and not receiver.pending
        u.kv = got[REQ]
        dst = engine(model, block_size=8)
        dst.import_request(u)
        assert dst.seqs[REQ].num_cached_tokens == u.kv.num_tokens == 11 + len(u.token_ids) - 1   # adopted
        done = []
        while dst.has_unfinished():
            done += dst.step()
        assert dst.num_prefill_tokens == 0
        outs[temperature] = done[0]
    return {t: (o.token_ids, o.logprobs) for t, o in outs.items()}


def test_a_migrated_request_s_kv_moves_between_ranks_and_decoding_continues_identically():
    want, got = dist_utils.run_world(_move, 2, deadline_s=120)
    for t in (0.0, 1.0):
        assert got[t] == want[t]   # exactly: the same K/V, the same generator state
        assert 0 < len(want[t][0]) == 10


def _frozen_sender(rank: int, world: int, run_dir: str):
    from runtime import watchdog
    from runtime.kv_transfer import KVReceiver
    store = dist.distributed_c10d._get_default_store()
    watchdog.install(run_dir, rank, world, ["rollout, engine 0", "rollout, engine 1"], store, timeout_s=1.0)
    if rank == 1:
        receiver = KVReceiver(None, torch.device("cpu"))
        receiver.receive(REQ, 0)
        receiver.wait_all()   # rank 0 never sends: the watchdog ends this process
        raise AssertionError("the receive returned without a sender")
    end = time.monotonic() + 30   # alive and beating, never sending, until rank 1's report is written
    while time.monotonic() < end and not (Path(run_dir) / "stall-rank1.txt").exists():
        time.sleep(0.05)
    time.sleep(0.2)
    watchdog.uninstall()


def spawn_until_one_exits(fn, world: int, *args, deadline_s: float) -> None:
    """Like dist_utils.run_world, for a world one of whose ranks is meant to die: raises the first rank's exit
    (mp.ProcessExitedException; torch.multiprocessing then ends the others), TimeoutError past `deadline_s`."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(dist_utils._entry, args=(fn, world, dist_utils.free_port(), outdir, args),
                                 nprocs=world, join=False, start_method="spawn")
        end = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > end:
                    raise TimeoutError(f"world still running after {deadline_s}s: a hang")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()


def test_a_receiver_whose_sender_never_sends_ends_with_the_named_deadline_report(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(mp.ProcessExitedException) as e:
        spawn_until_one_exits(_frozen_sender, 2, str(tmp_path), deadline_s=60)
    assert e.value.error_index == 1 and e.value.exit_code == 3   # watchdog.STALL_EXIT_CODE
    assert time.monotonic() - t0 < 30   # the deadline (1 s, renewed by nothing), not the groups' 60 s timeout
    report = (tmp_path / "stall-rank1.txt").read_text()
    assert "waited" in report and "the KV of request 7 from rank 0" in report
    assert "no progress from rank(s) 0" in report

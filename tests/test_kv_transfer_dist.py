"""A migrated request's KV between two gloo ranks (runtime/kv_transfer.py): rank 0's worker keeps the KV at the
migrating Interrupt and sends it on SendKV, rank 1's worker receives it with the Start that resumes the request,
decodes on without a prefill, and finishes exactly as an uninterrupted run (a request whose KV is no longer kept
goes as "no KV"); and a receiver whose sender never sends
ends with the watchdog's named report (runtime/watchdog.py), not a hang."""
import dataclasses
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import dist_utils

pytestmark = pytest.mark.dist

REQ = 7


def _spec(tok, task):
    from runtime.messages import StartRequest
    prompt, answer = task.prompts()[0]
    return StartRequest(REQ, 0, 0, 0, tok.encode(prompt, add_special_tokens=False), answer)


def _finished(ch):
    """The scored trajectory of request REQ among the events a worker sent."""
    return next(e.payload for _, evs in ch.sent for e in evs if e.kind == "reward_scored" and e.req_id == REQ)


def _move(rank: int, world: int):
    from runtime.kv_transfer import KVSender, recv_kv
    from runtime.messages import SendKV, Start
    from sched.base import Interrupt
    from tests.test_rollout_worker import make_worker
    group = dist.new_group([0, 1], backend="gloo")
    w, ch, task, tok = make_worker(verify=False, max_new_tokens=12)
    w.rank, w.kv_group, w.kv_sender = rank, group, KVSender(group)
    spec = _spec(tok, task)
    box = [None]
    if rank == 0:
        w.handle(Start([spec]))
        for _ in range(4):
            w.step()
        w.handle(Interrupt(0, [REQ], dst=1))
        ev = next(e for _, evs in ch.sent + [(0, w.outbox)] for e in evs if e.kind == "trajectory_interrupted")
        assert ev.payload.meta["kv_rank"] == 0 and ev.data["kv_tokens"] > 0 and REQ in w.kv_out
        box = [ev.payload]
    dist.broadcast_object_list(box, src=0)   # the controller's part: the partial trajectory goes to the destination
    if rank == 0:
        w.handle(SendKV(REQ, 1))
        w.handle(SendKV(99, 1))   # a request whose KV this rank no longer keeps: "no KV"
        w.close()
        assert not w.kv_out and w.engine.block_manager.num_free == w.engine.block_manager.num_blocks
        return None
    part = box[0]
    w.handle(Start([dataclasses.replace(spec, partial=part)]))
    seq = w.engine.seqs[REQ]
    assert seq.num_cached_tokens == len(spec.prompt_ids) + len(part.response_ids) - 1   # adopted as cached
    while w.engine.has_unfinished():
        w.step()
    assert recv_kv(99, 0, group, torch.device("cpu")) is None
    w.close()
    assert w.engine.num_prefill_tokens == 0
    moved = _finished(ch)
    ref, ref_ch, _, _ = make_worker(verify=False, max_new_tokens=12)
    ref.handle(Start([spec]))
    while ref.engine.has_unfinished():
        ref.step()
    ref.close()
    want = _finished(ref_ch)
    return moved.response_ids, moved.logprobs, want.response_ids, want.logprobs, len(part.response_ids)


def test_a_migrated_request_s_kv_moves_between_ranks_and_decoding_continues_identically():
    _, (got, got_lp, want, want_lp, before) = dist_utils.run_world(_move, 2, deadline_s=120)
    assert 0 < before < len(want)
    assert got == want and got_lp == want_lp   # exactly: the same K/V, the same generator state


def _frozen_sender(rank: int, world: int, run_dir: str):
    from runtime import watchdog
    from runtime.kv_transfer import recv_kv
    store = dist.distributed_c10d._get_default_store()
    watchdog.install(run_dir, rank, world, ["rollout, engine 0", "rollout, engine 1"], store, timeout_s=1.0)
    if rank == 1:
        recv_kv(REQ, 0, None, torch.device("cpu"))   # rank 0 never sends: the watchdog ends this process
        raise AssertionError("recv_kv returned without a sender")
    end = time.monotonic() + 30   # alive and beating, never sending, until rank 1's report is written
    while time.monotonic() < end and not (Path(run_dir) / "stall-rank1.txt").exists():
        time.sleep(0.05)
    time.sleep(0.5)
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

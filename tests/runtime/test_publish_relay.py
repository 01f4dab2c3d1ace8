"""Laminar's relay chain (trainer/publish.py, `cluster.relay = "chain"`) on a gloo world of 4: global rank 0 is the
train leader, ranks 1-3 the rollout ranks' relays in chain order. The leader sends each piece to rank 1 only; every
relay receives from the one before and forwards to the one after. Every relay gets the published bytes (verified by
the per-tensor checksums) for every publication, a corrupted bucket is caught on every relay down the chain (so each
passes it on whole before it raises), and the leader's sends go to the first relay only."""
import pytest
import torch
import torch.distributed as dist

from tests.support.dist_utils import PG_TIMEOUT, new_group, run_world

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8, bias=False))


def _world(rank: int, world: int):
    import trainer.publish as publish
    train = new_group([0])
    pub = new_group([0, 1, 2, 3])
    chain = [1, 2, 3]
    if rank == 0:
        sent_to = []
        real_send = dist.send

        def spy(t, dst, *a, **kw):
            sent_to.append(dst)
            return real_send(t, dst, *a, **kw)
        dist.send = spy
        publisher = publish.WeightPublisher(model(), pub, train, bucket_bytes=1024, verify=True, chain=chain)
        publisher.publish(1)
        m = publisher.model
        with torch.no_grad():
            m[0].weight.add_(1.0)
        publisher.publish(2)
        original = publish.pack_bucket
        publish.pack_bucket = lambda *args: _flip(original(*args))
        publisher.publish(3)
        return dict(sent_to=sorted(set(sent_to)), w2={n: p.detach().clone() for n, p in m.named_parameters()})
    rx = publish.WeightReceiver(pub, src=0, chain=chain)
    got = []
    for _ in range(2):
        out: dict = {}
        version = rx.receive(lambda it, v: out.update({n: t.clone() for n, t in it}))
        got.append((version, out, rx.header is not None))
    error = None
    try:
        rx.receive(lambda it, v: [None for _ in it])
    except publish.WeightChecksumError as e:
        error = str(e)
    return dict(got=got, error=error, prev=rx.prev, next=rx.next, peers=rx.peers)


def _flip(buf):
    buf[0] ^= 1
    return buf


def test_the_relay_chain_delivers_every_relay_the_published_bytes_and_the_leader_sends_once():
    leader, *relays = run_world(_world, 4, deadline_s=120)
    assert leader["sent_to"] == [1]   # the trainer's stall: one copy, to the master relay
    assert [(r["prev"], r["next"]) for r in relays] == [(0, 2), (1, 3), (2, None)]
    assert [r["peers"] for r in relays] == [[0, 2], [1, 3], [2]]   # whom a relay's declared wait names
    for r in relays:
        (v1, w1, _), (v2, w2, has_header) = r["got"]
        assert (v1, v2) == (1, 2) and has_header
        assert set(w2) == set(leader["w2"])
        for name, t in leader["w2"].items():
            assert torch.equal(w2[name], t), name
        assert not torch.equal(w1["0.weight"], w2["0.weight"])
        assert r["error"] is not None and "arrived corrupted" in r["error"]


def test_the_routes_bench_runs_and_prints_its_ratio_line(capsys):
    from bench import relay
    assert relay.main(["--mib", "1", "--relays", "2", "--bucket-mib", "1", "--repeats", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("broadcast / chain: trainer stall ") and "last relay filled" in last
    # the chain's leader sends the weights once (Laminar App. C: the trainer's stall is one copy); gloo's broadcast
    # root sends one copy per level of its tree (2 for 2 receivers): bytes written to the sockets, every thread
    broadcast, chain = (float(x) for x in last.split("leader's copies of the weights sent ")[1].split(" / "))
    assert 0.99 <= chain <= 1.05 and broadcast >= 1.9


@pytest.mark.parametrize("frozen", [1, 2])
def test_a_frozen_relay_in_the_chain_ends_the_job_with_a_report_naming_it(frozen, tmp_path):
    """Real ranks (1 train + 2 rollout, `cluster.relay = "chain"`): the master relay (rank 1) or the last one
    (rank 2), SIGSTOPped mid-publication, ends the job within the deadline with a stall report naming it."""
    import os
    import subprocess
    import sys
    import time
    from tests.e2e.test_train_e2e import ROOT, free_port
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "--master_port", str(free_port()),
           "train.py", "--config", "configs/tiny.toml", "--log.progress=false", "--log.plots=false", f"--log.dir={run}",
           "--cluster.rollout_ranks=2", "--cluster.relay=chain", "--train.steps=4", "--rollout.prompts_per_step=8",
           "--checkpoint.export_hf=false", "--cluster.timeout_s=5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TIDAL_FAULTS": f"freeze {frozen} publish 1"}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and time.monotonic() - t0 < 90
    reports = [p.read_text() for p in run.glob("stall-rank*.txt")]
    assert reports and all(f"rank {frozen} (rollout, engine {frozen - 1})" in r for r in reports), reports


def _gpu_world(rank: int, world: int, route: str):
    """The runtime's publication group on a GPU host (runtime/topology.py: gloo for CPU tensors, NCCL for CUDA ones):
    the leader's weights on the GPU, the relay's buffers in host memory, as train.py's rollout ranks receive them."""
    import trainer.publish as publish
    pub = dist.new_group([0, 1], backend="cpu:gloo,cuda:nccl", timeout=PG_TIMEOUT)
    train = new_group([0])
    chain = [1] if route == "chain" else None
    if rank == 0:
        m = model().to("cuda")
        publish.WeightPublisher(m, pub, train, bucket_bytes=1024, verify=True, chain=chain).publish(1)
        return None
    got = {}
    publish.WeightReceiver(pub, src=0, device="cpu", chain=chain).receive(
        lambda it, v: got.update({n: t.clone() for n, t in it}))
    return got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("route", ["broadcast", "chain"])
def test_weights_on_the_gpu_reach_a_host_relay_over_the_mixed_group(route):
    """A CUDA bucket on the leader and a CPU buffer on the relay would run the two ends on different backends (NCCL
    and gloo) and hang until the group's timeout: publications travel in host memory. One GPU suffices (the relay
    process never touches it)."""
    _, got = run_world(_gpu_world, 2, route, deadline_s=90)
    want = model().state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)

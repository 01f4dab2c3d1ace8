"""The trainer across processes: a gloo world of 3 where global rank 0 is a rollout (receiver) rank and ranks 1-2
are the train partition (so the train leader is NOT global rank 0, which the runtime avoids because DCP's full state
dicts go to global rank 0: docs/architecture.md, "Runtime"). One world runs, in order:
FSDP2 train steps (activation checkpointing on, KL to a sharded reference, minibatches, a step where one rank has
no data), a DCP checkpoint, weight publication with verification, a crash inside a checkpoint save, resume into a
fresh model, a deliberately corrupted publication, and an HF export. The main process compares against the same
steps run unsharded in one process."""
import resource
import signal

import pytest
import torch

from config import TrainConfig
from model import Transformer, cu_seqlens_from_lengths
from tests.support.dist_utils import new_group, run_world
from tests.support.trainer import SMOOTH_ADAM, make_groups, tiny_cfg, tiny_model
from trainer import Trainer
from trainer.checkpoint import CheckpointError, latest
from trainer.fsdp import full_state_dict

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

CFG = dict(lr=1e-2, grad_clip=0.5, micro_batch_tokens=24, minibatches=2, kl_coef=0.05, loss_agg="seq_mean",
           clip_high=0.28, warmup_steps=1, lr_schedule="cosine", steps=4, weight_decay=0.01, **SMOOTH_ADAM)


def batches():
    return [make_groups(1), make_groups(2), make_groups(3, n_groups=1, group_size=2)]  # the last: 1 sequence/minibatch


def _world(rank: int, world: int, tmp: str):
    train, pub = new_group([1, 2]), new_group([0, 1])
    if rank == 0:
        return _receiver(pub)
    import trainer.publish as publish
    b = batches()
    tr = Trainer(tiny_model(), TrainConfig(**CFG, activation_checkpointing=True), group=train, ref_model=tiny_model())
    metrics = [tr.train_step(b[0]), tr.train_step(b[1])]
    tr.save_checkpoint(f"{tmp}/ckpt", extra={"data_position": 2})
    metrics.append(tr.train_step(b[2]))
    w3 = full_state_dict(tr.model)
    publisher = publish.WeightPublisher(tr.model, pub if rank == 1 else None, train, bucket_bytes=2048, verify=True)
    publisher.publish(3)

    crashed = None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 2:  # only this rank's writes fail (EFBIG past 1 KiB, as on a full disk): every rank must raise
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
    try:
        tr.save_checkpoint(f"{tmp}/ckpt", extra={"data_position": 3})
    except CheckpointError as e:
        crashed = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    latest_after_crash = str(latest(f"{tmp}/ckpt"))

    fresh = Trainer(tiny_model(seed=7), TrainConfig(**CFG, activation_checkpointing=True), group=train,
                    ref_model=tiny_model())
    extra = fresh.load_checkpoint(latest(f"{tmp}/ckpt"))
    resumed_step = fresh.step
    fresh.train_step(b[2])
    w3_resumed = full_state_dict(fresh.model)

    corrupt_bucket = 2
    if rank == 1:  # flip one bit of the third bucket's first tensor after its checksum was taken
        calls = {"n": 0}
        original = publish.pack_bucket

        def corrupting(*args):
            buf = original(*args)
            if calls["n"] == corrupt_bucket:
                buf[0] ^= 1
            calls["n"] += 1
            return buf
        publish.pack_bucket = corrupting
    publisher.publish(4)
    corrupted_name = publisher.params[publisher.buckets[corrupt_bucket][0]][0]
    fresh.export_hf(f"{tmp}/hf")
    return dict(metrics=metrics, w3=w3, w3_resumed=w3_resumed, crashed=crashed, latest=latest_after_crash,
                extra=extra, resumed_step=resumed_step, corrupted=corrupted_name,
                first_bucket=[publisher.params[i][0] for i in publisher.buckets[0]])


def _receiver(pub):
    from trainer.publish import WeightChecksumError, WeightReceiver
    rx = WeightReceiver(pub, src=1)
    got: dict = {}
    version = rx.receive(lambda it, v: got.update({n: t.clone() for n, t in it}))
    loaded_then: list = []
    error = None
    try:
        rx.receive(lambda it, v: loaded_then.extend(n for n, _ in it))
    except WeightChecksumError as e:
        error = str(e)
    return dict(got=got, version=version, error=error, loaded_then=loaded_then)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    return run_world(_world, 3, str(tmp)), tmp


@pytest.fixture(scope="module")
def reference():
    tr = Trainer(tiny_model(), TrainConfig(**CFG), ref_model=tiny_model())
    metrics = [tr.train_step(b) for b in batches()]
    return metrics, {n: p.detach() for n, p in tr.model.named_parameters()}


def test_fsdp_two_ranks_match_one_process(world, reference):
    (rx, t1, t2), _ = world
    ref_metrics, ref_w = reference
    for w in (t1["w3"], t2["w3"]):
        assert set(w) == set(ref_w) - {"lm_head.weight"}  # tied: sent and gathered once
        for name, p in w.items():
            assert torch.allclose(p, ref_w[name], atol=1e-5, rtol=0), name
    for got, want in zip(t1["metrics"], ref_metrics):
        for k in ("loss", "grad_norm", "clip_frac_low", "clip_frac_high", "kl_ref", "entropy", "lr", "tokens"):
            assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    assert ref_metrics[0]["grad_norm"] > CFG["grad_clip"]  # clipping was active


def test_publication_is_bit_exact(world):
    (rx, t1, _), _ = world
    assert rx["version"] == 3
    assert set(rx["got"]) == set(t1["w3"])
    for name, t in rx["got"].items():
        assert torch.equal(t, t1["w3"][name]), name


def test_corrupted_tensor_is_named_and_not_loaded(world):
    (rx, t1, _), _ = world
    assert rx["error"] is not None and repr(t1["corrupted"]) in rx["error"]
    assert t1["corrupted"] not in rx["loaded_then"]
    assert set(t1["first_bucket"]) <= set(rx["loaded_then"])  # the buckets before it were fine


def test_resume_after_crash_equals_uninterrupted_run(world):
    (_, t1, t2), tmp = world
    for t in (t1, t2):  # the write failed on rank 2 only; both ranks raised it, naming the path and the rank
        assert f"could not write checkpoint {tmp / 'ckpt' / 'step_3'}" in t["crashed"], t["crashed"]
        assert "rank 1: OSError: [Errno 27] File too large" in t["crashed"], t["crashed"]
        assert f"The previous checkpoint is untouched: {tmp / 'ckpt' / 'step_2'}" in t["crashed"]
        assert t["latest"].endswith("step_2")
        assert t["extra"] == {"data_position": 2} and t["resumed_step"] == 2
        for name, p in t["w3"].items():
            assert torch.allclose(t["w3_resumed"][name], p, atol=1e-7, rtol=0), name
    assert not (tmp / "ckpt" / ".tmp_step_3").exists() and not (tmp / "ckpt" / "step_3").exists()


def test_hf_export_loads_in_transformers_and_matches_logits(world):
    from transformers import AutoModelForCausalLM
    (_, t1, _), tmp = world
    hf = AutoModelForCausalLM.from_pretrained(str(tmp / "hf")).eval()
    ours = Transformer(tiny_cfg()).eval()
    ours.load_state_dict(t1["w3_resumed"], strict=False)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.randint(0, 64, (19,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours.forward_packed(ids, cu_seqlens_from_lengths([19]))
        got = hf(ids[None]).logits[0]
    assert (got - want).abs().max().item() < 1e-4


def _overlapped(rank: int, world: int, tmp: str):
    """Rank 0 receives; ranks 1-2 train. Version 1 is gathered, then sent in the background while the next step's
    FSDP collectives run: the receiver must get version 1's weights, not the ones training moved on to."""
    train, pub = new_group([1, 2]), new_group([0, 1])
    from trainer.publish import WeightPublisher, WeightReceiver
    if rank == 0:
        got: dict = {}
        version = WeightReceiver(pub, src=1).receive(lambda it, v: got.update({n: t.clone() for n, t in it}))
        return dict(got=got, version=version)
    from runtime.train_worker import AsyncSender
    b = batches()
    tr = Trainer(tiny_model(), TrainConfig(**{**CFG, "kl_coef": 0.0}), group=train)
    tr.train_step(b[0])
    w1 = full_state_dict(tr.model)
    publisher = WeightPublisher(tr.model, pub if rank == 1 else None, train, bucket_bytes=2048, verify=True)
    packed = publisher.pack(1)
    sender = AsyncSender(on=[0, 1])
    if rank == 1:
        sender.submit(lambda: publisher.send(packed))
    tr.train_step(b[1])                     # collectives on the train group while the broadcast goes out
    sender.wait()
    return dict(w1=w1, w2=full_state_dict(tr.model))


def test_an_overlapped_publication_sends_the_gathered_version_while_training_goes_on():
    rx, t1, _ = run_world(_overlapped, 3, "")
    assert rx["version"] == 1 and set(rx["got"]) >= set(t1["w1"])
    assert all(torch.equal(rx["got"][n], t1["w1"][n]) for n in t1["w1"])
    assert any(not torch.equal(t1["w2"][n], t1["w1"][n]) for n in t1["w1"])  # training did move on

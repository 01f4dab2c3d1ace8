"""The trainer on one FSDP2 rank (the GPU's colocated case, here on a one-rank gloo world on CPU): the gradient
reduction deferred to a chunk's last micro-batch (Trainer.DEFER_GRAD_SYNC) gives the same gradients, losses and
weights as a reduction after every micro-batch, and the stats summed on the device give the same metrics."""
import pytest
import torch

from config import TrainConfig
from rl.advantages import compute_advantages
from tests.support.dist_utils import run_world
from tests.support.trainer import SMOOTH_ADAM, make_groups, tiny_model
from trainer import Trainer
from trainer.batch import build_samples
from trainer.fsdp import full_state_dict, full_tensor, is_sharded

pytestmark = [pytest.mark.dist, pytest.mark.usefixtures("one_thread")]

CFG = dict(lr=1e-2, grad_clip=0.5, micro_batch_tokens=24, steps=2, **SMOOTH_ADAM)


def _one_rank(rank: int, world: int):
    Trainer.SHARD_ONE_CPU_RANK = True
    out = {}
    for defer in (False, True):
        Trainer.DEFER_GRAD_SYNC = defer
        tr = Trainer(tiny_model(), TrainConfig(**CFG))
        calls: list[bool] = []
        sync = tr.model.set_requires_gradient_sync
        tr.model.set_requires_gradient_sync = lambda on, **kw: (calls.append(on), sync(on, **kw))[1]
        groups = make_groups(1)
        tr.train_step(groups, step=False)   # gradients only, then read them
        grads = {n: full_tensor(p.grad).clone() for n, p in tr.model.named_parameters() if p.grad is not None}
        metrics = [tr.train_step(make_groups(2))] + [tr.train_step(make_groups(3))]
        micro = len(list(tr._micro_batches(build_samples(compute_advantages(groups, "std", False)))))
        out[defer] = dict(grads=grads, metrics=metrics, w=full_state_dict(tr.model), calls=calls,
                          sharded=is_sharded(tr.model), micro=micro)
    return out


def test_deferred_gradient_sync_on_one_rank_trains_exactly_as_a_sync_per_micro_batch():
    got = run_world(_one_rank, 1)[0]
    every, last = got[False], got[True]
    assert every["sharded"] and last["sharded"]
    assert every["calls"] == []
    n = last["micro"]
    assert n > 2   # several micro-batches, or nothing is deferred
    # the first call: False for every micro-batch but the chunk's last, then True again after it
    assert last["calls"][:n + 1] == [False] * (n - 1) + [True, True]
    assert every["grads"].keys() == last["grads"].keys() and every["grads"]
    for name, g in every["grads"].items():
        assert torch.allclose(g, last["grads"][name], atol=1e-6, rtol=1e-5), name
    for a, b in zip(every["metrics"], last["metrics"]):
        for k in ("loss", "pg_loss", "entropy", "approx_kl", "ratio_mean", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    for name, w in every["w"].items():
        assert torch.allclose(w, last["w"][name], atol=1e-6, rtol=0), name


def test_device_side_stats_match_an_unsharded_process():
    """The stats summed on the device and read once per chunk: the same metrics at micro-batch budgets that cut the
    step into one or many micro-batches."""
    out = []
    for budget in (1000, 16):
        tr = Trainer(tiny_model(), TrainConfig(**dict(CFG, micro_batch_tokens=budget)))
        out.append(tr.train_step(make_groups(4)))
    for k in ("loss", "pg_loss", "entropy", "approx_kl", "ratio_mean", "clip_frac_low", "clip_frac_high"):
        assert out[0][k] == pytest.approx(out[1][k], rel=1e-5, abs=1e-7), k
    assert out[0]["tokens"] == out[1]["tokens"] > 0

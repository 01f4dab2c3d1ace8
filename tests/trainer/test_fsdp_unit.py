"""`train.fsdp_unit` (trainer/fsdp.py shard_model): one FSDP2 unit per block, or the whole model as one unit (one
all-gather and one reduce-scatter a micro-batch). On two gloo ranks both train exactly as one unsharded process
does, with KL to a sharded reference too, and "model" leaves the blocks unwrapped."""
import pytest
import torch

from config import TrainConfig
from tests.support.dist_utils import run_world
from tests.support.trainer import SMOOTH_ADAM, make_groups, tiny_model
from trainer import Trainer
from trainer.fsdp import full_state_dict, is_sharded

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

CFG = dict(lr=1e-2, grad_clip=0.5, micro_batch_tokens=24, kl_coef=0.05, steps=2, **SMOOTH_ADAM)


def _world(rank: int, world: int):
    out = {}
    for unit in ("block", "model"):
        tr = Trainer(tiny_model(), TrainConfig(**CFG, fsdp_unit=unit), ref_model=tiny_model())
        metrics = [tr.train_step(make_groups(s)) for s in (1, 2)]
        out[unit] = dict(loss=[m["loss"] for m in metrics], w=full_state_dict(tr.model),
                         blocks_wrapped=[is_sharded(b) for b in tr.model.model.layers], root=is_sharded(tr.model))
    return out


def test_one_fsdp_unit_or_one_per_block_train_alike_and_as_one_process():
    ranks = run_world(_world, 2)
    ref = Trainer(tiny_model(), TrainConfig(**CFG), ref_model=tiny_model())
    ref_loss = [ref.train_step(make_groups(s))["loss"] for s in (1, 2)]
    ref_w = {n: p.detach() for n, p in ref.model.named_parameters()}
    for got in ranks:
        assert got["block"]["blocks_wrapped"] == [True] * len(got["block"]["blocks_wrapped"])
        assert not any(got["model"]["blocks_wrapped"]) and got["model"]["root"]
        for unit in ("block", "model"):
            assert got[unit]["loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6), unit
            for name, p in got[unit]["w"].items():
                assert torch.allclose(p, ref_w[name], atol=1e-5, rtol=0), (unit, name)


def test_an_unknown_unit_is_refused_by_name():
    from trainer.fsdp import shard_model
    with pytest.raises(ValueError, match="unknown FSDP unit 'layer'"):
        shard_model(tiny_model(), mesh=None, unit="layer")

"""train.compile (trainer/compile.py): each block's forward compiled by inductor, its attention left eager. On one
FSDP2 rank with activation checkpointing (the GPU's colocated case, here on a one-rank gloo world on CPU) and on one
unsharded rank (a CPU run's) it trains as the eager modules do, with one compiled code for every block and every
micro-batch shape."""
import dataclasses
import shutil

import pytest
import torch

from config import TrainConfig
from tests.support.dist_utils import run_world
from tests.support.trainer import SMOOTH_ADAM, make_groups, tiny_cfg
from trainer import Trainer
from trainer.fsdp import full_state_dict, is_sharded

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                                 reason="inductor's CPU code needs a C++ compiler")]

# 4 blocks, so one compiled code per block would show; micro-batches of varied token counts
CFG = dict(lr=1e-2, grad_clip=0.5, micro_batch_tokens=24, steps=3, activation_checkpointing=True, **SMOOTH_ADAM)
RUNS = (("eager", True), ("compiled", True), ("compiled", False))   # (modules, FSDP2 on the one rank)


def _one_rank(rank: int, world: int):
    from torch._dynamo.utils import counters

    from model import Transformer
    out = {}
    for modules, shard in RUNS:
        Trainer.SHARD_ONE_CPU_RANK = shard
        torch._dynamo.reset()   # each run compiles afresh: no run reuses another's code
        graphs = counters["stats"]["unique_graphs"]
        model = Transformer(dataclasses.replace(tiny_cfg(), num_layers=4)).init_weights(std=0.1, seed=0)
        tr = Trainer(model, TrainConfig(**CFG, compile=modules == "compiled"))
        metrics = [tr.train_step(make_groups(seed)) for seed in (1, 2, 3)]
        out[modules, shard] = dict(metrics=metrics, w=full_state_dict(tr.model), sharded=is_sharded(tr.model),
                                   graphs=counters["stats"]["unique_graphs"] - graphs)
    return out


def test_compiled_blocks_train_as_the_eager_ones_with_one_code_for_every_block():
    got = run_world(_one_rank, 1, deadline_s=480)[0]
    eager = got["eager", True]
    assert eager["sharded"] and got["compiled", True]["sharded"] and not got["compiled", False]["sharded"]
    assert eager["graphs"] == 0
    for key in (("compiled", True), ("compiled", False)):
        comp = got[key]
        # the compiled run ran compiled code: two graphs a block (before and after its eager attention) and two
        # resumptions, shared by the 4 blocks and every micro-batch; a code per block would be >= 7 (an FSDP2
        # module's attributes are never guarded on; an unsharded block's layer index would be, but for
        # allow_unspec_int_on_nn_module)
        assert 0 < comp["graphs"] <= 4, (key, comp["graphs"])
        for a, b in zip(eager["metrics"], comp["metrics"]):
            for k in ("loss", "pg_loss", "entropy", "approx_kl", "grad_norm"):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (key, k, a[k], b[k])
        assert eager["w"].keys() == comp["w"].keys()   # the parameter names stay the HF ones
        for name, w in eager["w"].items():
            assert torch.allclose(w, comp["w"][name], atol=1e-5, rtol=0), (key, name,
                                                                            (w - comp["w"][name]).abs().max())


def test_compiled_blocks_follow_torchs_deterministic_setting():
    """runtime/build.py sets inductor's determinism flag only where inductor was already imported; compile_blocks
    imports it, so it sets the flag from torch's own setting."""
    from torch._inductor import config as inductor_config

    from model import Transformer
    from trainer.compile import compile_blocks
    was = torch.are_deterministic_algorithms_enabled()
    try:
        for on in (True, False):
            torch.use_deterministic_algorithms(on, warn_only=True)
            assert compile_blocks(Transformer(tiny_cfg())) == 2
            assert inductor_config.deterministic is on
    finally:
        torch.use_deterministic_algorithms(was)

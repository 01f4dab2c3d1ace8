"""Gradient accumulation (`train_step(groups, step=False)`, RollPacker's stream trainer): the one optimizer step
after several accumulating calls has the gradient of one call on all the groups together, for every loss
aggregation, in one process and on 2 FSDP ranks; non-stepping calls leave weights, optimizer and version alone."""
import pytest
import torch

from config import TrainConfig
from tests.support.dist_utils import run_world
from tests.support.trainer import SMOOTH_ADAM, make_groups, on_policy_groups, tiny_model, weights
from trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

AGGS = [("token_mean", "token"), ("seq_mean", "token"), ("seq_sum_norm", "token"), ("token_mean", "sequence")]


def split_batches():
    """Three stream batches of different sizes, and the same groups as one batch."""
    parts = [make_groups(11, n_groups=1), make_groups(12, n_groups=3, group_size=3), make_groups(13, n_groups=2)]
    return parts, [g for p in parts for g in p]


def capture_grads(tr: Trainer) -> list:
    """Record the (clipped) gradients the optimizer steps with."""
    seen = []
    tr.optimizer.register_step_pre_hook(lambda *_: seen.append(
        {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}))
    return seen


def cfg(agg, level, **kw):
    return TrainConfig(lr=1e-2, loss_agg=agg, ratio_level=level, micro_batch_tokens=30, grad_clip=1e9, **SMOOTH_ADAM,
                       **kw)


@pytest.mark.parametrize("agg,level", AGGS)
def test_accumulated_step_equals_one_step_on_everything(agg, level):
    parts, everything = split_batches()
    one = Trainer(tiny_model(), cfg(agg, level), max_response_len=10)
    g_one = capture_grads(one)
    m_one = one.train_step(everything)

    acc = Trainer(tiny_model(), cfg(agg, level), max_response_len=10)
    g_acc = capture_grads(acc)
    before = weights(acc.model)
    ms = [acc.train_step(parts[0], step=False), acc.train_step(parts[1], step=False)]
    assert all(m["optimizer_steps"] == 0 and m["skipped"] == 0 and "grad_norm" not in m for m in ms)
    assert all(torch.equal(before[n], p) for n, p in weights(acc.model).items())   # nothing applied yet
    assert acc.step == 0 and acc.optimizer_steps == 0 and not acc.optimizer.state   # optimizer untouched
    m_last = acc.train_step(parts[2], step=True)
    assert m_last["optimizer_steps"] == 1 and acc.step == 1 and acc.optimizer_steps == 1 and acc.accumulated == 0

    assert len(g_one) == len(g_acc) == 1
    assert g_one[0].keys() == g_acc[0].keys()
    for name, g in g_one[0].items():  # the same gradient, up to fp32 summation order
        assert (g_acc[0][name] - g).abs().max() <= 1e-5 * g.abs().max(), name
    assert m_last["grad_norm"] == pytest.approx(m_one["grad_norm"], rel=1e-5)
    for name, p in weights(one.model).items():
        assert torch.allclose(weights(acc.model)[name], p, atol=1e-5, rtol=0), name
    # each call's loss is its own batch's mean: the sample-weighted mean of the parts is the whole batch's
    n = [m["tokens" if agg == "token_mean" else "sequences"] for m in ms + [m_last]]
    mean = sum(m["loss"] * k for m, k in zip(ms + [m_last], n)) / sum(n)
    assert mean == pytest.approx(m_one["loss"], rel=1e-5, abs=1e-7)


def test_stepping_call_with_nothing_of_its_own_applies_the_accumulation():
    parts, everything = split_batches()
    one = Trainer(tiny_model(), cfg("token_mean", "token", filter_zero_variance=True))
    one.train_step(everything)
    acc = Trainer(tiny_model(), cfg("token_mean", "token", filter_zero_variance=True))
    acc.train_step(everything, step=False)
    flat = make_groups(14, n_groups=1)
    for t in flat[0].trajectories:
        t.reward = 1.0                                   # zero variance: filtered, no samples of its own
    m = acc.train_step(flat, step=True)
    assert m["optimizer_steps"] == 1 and m["skipped"] == 0 and "grad_norm" in m
    for name, p in weights(one.model).items():
        assert torch.allclose(weights(acc.model)[name], p, atol=1e-5, rtol=0), name


def test_old_logprobs_stay_the_generating_versions_after_intermediate_steps():
    """RolloutPipe's every-U update steps mid-round: a later batch of the round keeps the round's behaviour
    log-probs (from the engine), so its ratio is taken against the generating weights, not the stepped ones."""
    model = tiny_model(tied=False)
    first, later = on_policy_groups(model, seed=1), on_policy_groups(model, seed=2)  # one round, version 0
    tr = Trainer(model, TrainConfig(lr=1e-2, micro_batch_tokens=64))
    m1 = tr.train_step(first)
    m2 = tr.train_step(later)                        # the trainer is at version 1 now
    assert m1["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m1["approx_kl"] == pytest.approx(0.0, abs=1e-8)
    assert abs(m2["ratio_mean"] - 1.0) > 1e-4 and m2["approx_kl"] > 1e-7


def test_accumulation_misuse_is_refused(tmp_path):
    with pytest.raises(ValueError, match="minibatches"):
        Trainer(tiny_model(), TrainConfig(minibatches=2)).train_step(make_groups(1), step=False)
    tr = Trainer(tiny_model(), TrainConfig())
    tr.train_step(make_groups(1), step=False)
    with pytest.raises(RuntimeError, match="accumulated gradients"):
        tr.save_checkpoint(tmp_path)


def _two_ranks(rank, world, agg):
    torch.manual_seed(0)
    parts, _ = split_batches()
    tr = Trainer(tiny_model(), cfg(agg, "token"), max_response_len=10)
    for i, p in enumerate(parts):
        tr.train_step(p, step=i == len(parts) - 1)
    return {n: p.full_tensor() for n, p in tr.model.named_parameters()}


@pytest.mark.dist
@pytest.mark.slow
def test_two_fsdp_ranks_accumulate_like_one_process():
    _, everything = split_batches()
    one = Trainer(tiny_model(), cfg("seq_mean", "token"), max_response_len=10)
    one.train_step(everything)
    for w in run_world(_two_ranks, 2, "seq_mean"):
        for name, p in weights(one.model).items():
            assert torch.allclose(w[name], p, atol=1e-5, rtol=0), name

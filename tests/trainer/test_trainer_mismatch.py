"""The trainer's off-policy corrections and per-step mismatch metrics (rl/correction.py, rl/mismatch.py) on a tiny
model whose behaviour log-probs are its own sampling log-probs, perturbed by a known amount."""
import copy

import pytest
import torch

from config import TrainConfig
from trainer import Trainer
from trainer.fsdp import full_state_dict
from tests.support.dist_utils import run_world
from tests.support.trainer import on_policy_groups, tiny_model, weights

pytestmark = pytest.mark.usefixtures("one_thread")


def perturbed(groups, eps, seed=0, only=None):
    """Copies of `groups` with eps * N(0, 1) added to every behaviour log-prob (of group index `only`, if given)."""
    g = torch.Generator().manual_seed(seed)
    out = copy.deepcopy(groups)
    for gi, group in enumerate(out):
        for t in group.trajectories:
            noise = torch.randn(len(t.logprobs), generator=g, dtype=torch.float64) * eps
            if only is None or gi == only:
                t.logprobs = [lp + float(x) for lp, x in zip(t.logprobs, noise)]
    return out


def cfg(**kw):
    return TrainConfig(**{"lr": 1e-2, "micro_batch_tokens": 40, **kw})


@pytest.fixture(scope="module")
def start():
    model = tiny_model(seed=1)
    return model, on_policy_groups(model, seed=5, n_groups=3, group_size=4, resp_len=4)


def test_mismatch_kl_and_the_masked_fraction_grow_with_the_perturbation(start):
    model, groups = start
    rows = []
    for eps in (0.0, 0.2, 1.0):
        tr = Trainer(copy.deepcopy(model), cfg(correction="token_mask", correction_low=0.7, correction_high=1.4))
        rows.append(tr.train_step(perturbed(groups, eps)))
    kl = [m["mismatch_kl_k3"] for m in rows]
    masked = [m["correction_masked_frac"] for m in rows]
    assert kl[0] < 1e-6 and kl[0] < kl[1] < kl[2], kl      # the engine's log-probs are the trainer's at eps = 0
    assert masked[0] == 0.0 and masked[0] < masked[1] < masked[2], masked
    for m in rows:
        assert m["mismatch_ratio_max"] >= m["mismatch_ratio_mean"] > 0
        assert m["mismatch_kl_k3_stale0"] == pytest.approx(m["mismatch_kl_k3"])   # every token is fresh
        assert not any(k in m for k in ("mismatch_kl_k3_stale1", "mismatch_kl_k3_stale2_3", "is_weight_mean"))
        assert m["correction_clipped_frac"] == 0.0 and 0 < m["correction_weight_mean"]


def test_the_default_config_reports_the_mismatch_and_no_correction(start):
    """Behaviour path, one step per call: the trainer-side log-probs are the current ones, so KL(behaviour ||
    trainer) is the ratio's approx_kl (the same k3 on the same log ratio)."""
    model, groups = start
    m = Trainer(copy.deepcopy(model), cfg()).train_step(perturbed(groups, 0.3))
    assert m["mismatch_kl_k3"] == pytest.approx(m["approx_kl"], rel=1e-6) and m["mismatch_kl_k3"] > 1e-3
    assert m["mismatch_ratio_mean"] == pytest.approx(m["ratio_mean"], rel=1e-6)
    assert not any(k.startswith(("correction_", "is_")) for k in m)


def test_correction_none_ignores_the_correction_thresholds_bit_for_bit(start):
    model, groups = start
    data = perturbed(groups, 0.5)
    a, b = (Trainer(copy.deepcopy(model), c) for c in (
        cfg(), cfg(correction="none", correction_low=0.9, correction_high=1.1, opsm_delta=0.0, m2po_tau=1e-6)))
    ma, mb = a.train_step(data), b.train_step(data)
    assert all(ma[k] == mb[k] for k in ma if not k.endswith("_s"))   # seconds differ run to run
    wa, wb = weights(a.model), weights(b.model)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_a_correction_changes_the_update_on_the_behaviour_path(start):
    model, groups = start
    data = perturbed(groups, 1.0)
    plain = Trainer(copy.deepcopy(model), cfg())
    tis = Trainer(copy.deepcopy(model), cfg(correction="tis", correction_high=1.5))
    m = tis.train_step(data)
    plain.train_step(data)
    assert 0 < m["correction_clipped_frac"] < 1
    wp, wt = weights(plain.model), weights(tis.model)
    assert any(not torch.allclose(wp[n], wt[n]) for n in wp)


def test_the_mismatch_is_split_by_staleness_bucket(start):
    """Trainer at version 5: group 0's tokens are fresh (version 5), group 1's stale by 5 (version 0), group 2's by 2;
    only group 1's behaviour log-probs are perturbed."""
    model, groups = start
    data = perturbed(groups, 1.0, only=1)
    for gi, version in enumerate((5, 0, 3)):
        for t in data[gi].trajectories:
            t.versions = [version] * len(t.response_ids)
    tr = Trainer(copy.deepcopy(model), cfg())
    tr.step = 5
    m = tr.train_step(data)
    assert m["mismatch_kl_k3_stale0"] < 1e-6 and m["mismatch_kl_k3_stale2_3"] < 1e-6
    assert m["mismatch_kl_k3_stale4plus"] > 1e-2 and "mismatch_kl_k3_stale1" not in m
    # each bucket holds 16 of the 48 tokens: the step's KL is their mean
    parts = (m["mismatch_kl_k3_stale0"], m["mismatch_kl_k3_stale2_3"], m["mismatch_kl_k3_stale4plus"])
    assert m["mismatch_kl_k3"] == pytest.approx(sum(parts) / 3, rel=1e-6)


def test_several_optimizer_steps_measure_against_the_weights_at_the_start_of_the_call(start):
    """With a correction on, a no-grad pass gives the trainer-side log-probs before the first step, so unperturbed
    behaviour log-probs show no mismatch in the second minibatch either; without one, the metrics are the first
    minibatch's (the second's loss reads weights that already moved: its own mismatch is not ~0)."""
    model, groups = start
    with_c = Trainer(copy.deepcopy(model), cfg(lr=5e-2, minibatches=2, correction="tis"))
    without = Trainer(copy.deepcopy(model), cfg(lr=5e-2, minibatches=2))
    assert with_c.train_step(groups)["mismatch_kl_k3"] < 1e-6
    m = without.train_step(groups)
    assert m["mismatch_kl_k3"] < 1e-6 and m["mismatch_ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert m["approx_kl"] > 1e-6   # the second minibatch's ratio against the behaviour log-probs did move
    # perturbed behaviour log-probs: the same mismatch as the one-step call on the same data reads
    data = perturbed(groups, 0.5)
    one = Trainer(copy.deepcopy(model), cfg(lr=5e-2)).train_step(data)
    two = Trainer(copy.deepcopy(model), cfg(lr=5e-2, minibatches=2)).train_step(data)
    assert two["mismatch_kl_k3"] > 1e-2 and two["mismatch_kl_k3"] == pytest.approx(one["mismatch_kl_k3"], rel=0.5)


def test_bad_correction_values_are_errors():
    with pytest.raises(ValueError, match="correction 'ice'"):
        Trainer(tiny_model(), cfg(correction="ice"))
    with pytest.raises(ValueError, match="low < high"):
        Trainer(tiny_model(), cfg(correction="tis", correction_low=3.0))


def test_m2po_over_the_batch_ranks_every_micro_batch_together(start):
    """m2po_scope = "batch": the tokens of several micro-batches are ranked as one, so the step equals the same step
    taken on one micro-batch holding them all (where both scopes agree); ranking each micro-batch alone differs."""
    model, groups = start
    data = perturbed(groups, 1.0)

    def step(scope, tokens, **kw):
        tr = Trainer(copy.deepcopy(model), cfg(correction="m2po", m2po_tau=0.3, m2po_scope=scope,
                                               micro_batch_tokens=tokens, **kw))
        return tr.train_step(data), weights(tr.model)

    (one, w_one), (batch, w_batch), (micro, _) = step("micro_batch", 10**6), step("batch", 24), step("micro_batch", 24)
    assert 0 < one["correction_masked_frac"] < 1
    assert batch["correction_masked_frac"] == one["correction_masked_frac"]
    assert micro["correction_masked_frac"] != one["correction_masked_frac"]
    assert all(torch.allclose(w_batch[n], w_one[n], atol=1e-6) for n in w_one)
    # several optimizer steps a call (the trainer-side log-probs from the call's no-grad pass): the same agreement
    (one2, w_one2), (batch2, w_batch2) = step("micro_batch", 10**6, minibatches=1, ppo_epochs=2), \
        step("batch", 24, minibatches=1, ppo_epochs=2)
    assert batch2["correction_masked_frac"] == one2["correction_masked_frac"]
    assert all(torch.allclose(w_batch2[n], w_one2[n], atol=1e-6) for n in w_one2)


def _m2po_world(rank: int, world: int, data) -> dict:
    out = {}
    for scope in ("batch", "micro_batch"):
        tr = Trainer(tiny_model(seed=1), cfg(correction="m2po", m2po_tau=0.3, m2po_scope=scope, micro_batch_tokens=24))
        out[scope] = tr.train_step(data)["correction_masked_frac"], full_state_dict(tr.model)
    return out


@pytest.mark.dist
@pytest.mark.slow
def test_m2po_over_the_batch_ranks_the_tokens_of_every_train_rank_together(start):
    """Two FSDP2 ranks, each with its own micro-batches: the batch scope gathers both ranks' tokens, so the step is
    the one-process step over them all; ranking per micro-batch (on each rank's own tokens) masks differently."""
    model, groups = start
    data = perturbed(groups, 1.0)
    ref = Trainer(copy.deepcopy(model), cfg(correction="m2po", m2po_tau=0.3, m2po_scope="micro_batch",
                                            micro_batch_tokens=10**6))
    want = ref.train_step(data)["correction_masked_frac"]
    w_ref = weights(ref.model)
    for r in run_world(_m2po_world, 2, data):
        frac, w = r["batch"]
        assert frac == pytest.approx(want, abs=1e-12) and r["micro_batch"][0] != pytest.approx(want, abs=1e-12)
        assert all(torch.allclose(w[n], w_ref[n], atol=1e-5) for n in w)

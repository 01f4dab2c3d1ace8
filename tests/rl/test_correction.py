"""rl/correction.py and rl/mismatch.py against hand-computed references on a five-token batch, TRL's definitions, and
the loss they feed (rl/loss.py)."""
import math

import pytest
import torch

from rl.correction import CORRECTIONS, Correction, correct, m2po_keep
from rl.loss import policy_loss
from rl.mismatch import mismatch_sums

# two sequences: tokens 0-2 are sequence 0, tokens 3-4 sequence 1. The trainer-vs-behaviour ratios r = pi_trainer /
# pi_behaviour are chosen so that every product and mean below is easy to write out.
R = [3.0, 0.5, 1.0, 0.25, 1.5]
BEHAVIOUR = [-1.0, -2.0, -1.5, -0.5, -3.0]
SEQ = [0, 0, 0, 1, 1]
D = torch.float64


def tensors(adv=(1.0, -1.0)):
    beh = torch.tensor(BEHAVIOUR, dtype=D)
    lr = torch.tensor([math.log(r) for r in R], dtype=D)
    seq_idx = torch.tensor(SEQ)
    return beh, lr, seq_idx, torch.tensor([adv[s] for s in SEQ], dtype=D), torch.ones(5, dtype=D)


def run(kind, adv=(1.0, -1.0), **kw):
    _, lr, seq_idx, a, mask = tensors(adv)
    out = correct(Correction(kind, **kw), lr, a, seq_idx, mask, 2)
    return out.weight.tolist(), out.clipped.tolist(), out.masked.tolist()


def close(got, want):
    assert got == pytest.approx(want, abs=1e-12), (got, want)


def test_tis_truncates_each_token_ratio():
    # r = [3, 0.5, 1, 0.25, 1.5]; min(r, 2) and, with a lower bound 0.4, max(min(r, 2), 0.4)
    w, clipped, masked = run("tis", high=2.0)
    close(w, [2.0, 0.5, 1.0, 0.25, 1.5])
    assert clipped == [True, False, False, False, False] and not any(masked)
    w, clipped, _ = run("tis", low=0.4, high=2.0)
    close(w, [2.0, 0.5, 1.0, 0.4, 1.5])
    assert clipped == [True, False, False, True, False]


def test_token_mask_keeps_the_ratio_inside_the_bounds_and_zeroes_the_rest():
    # MIS / IcePop's M(k) = k on [alpha, beta], else 0; with [0.4, 2]: 3 and 0.25 fall outside
    w, clipped, masked = run("token_mask", low=0.4, high=2.0)
    close(w, [0.0, 0.5, 1.0, 0.0, 1.5])
    assert masked == [True, False, False, True, False] and not any(clipped)
    w, _, masked = run("token_mask", high=2.0)  # no lower bound: 0.25 stays, weighted by itself
    close(w, [0.0, 0.5, 1.0, 0.25, 1.5])


def test_sequence_level_is_uses_the_product_of_the_token_ratios():
    # products: sequence 0 = 3 * 0.5 * 1 = 1.5, sequence 1 = 0.25 * 1.5 = 0.375
    w, clipped, _ = run("seq_tis", low=0.4, high=2.0)
    close(w, [1.5, 1.5, 1.5, 0.4, 0.4])
    assert clipped == [False, False, False, True, True]
    w, clipped, _ = run("seq_tis", high=1.2)
    close(w, [1.2, 1.2, 1.2, 0.375, 0.375])
    w, _, masked = run("seq_mask", low=0.4, high=2.0)
    close(w, [1.5, 1.5, 1.5, 0.0, 0.0])
    assert masked == [False, False, False, True, True]


def test_geo_mask_rejects_on_the_geometric_mean_ratio():
    # geometric means: sequence 0 = 1.5 ** (1/3) = 1.1447, sequence 1 = 0.375 ** (1/2) = 0.6124
    assert 1.5 ** (1 / 3) == pytest.approx(1.1447142, abs=1e-6) and 0.375 ** 0.5 == pytest.approx(0.6123724, abs=1e-6)
    w, _, masked = run("geo_mask", low=0.7, high=2.0)
    close(w, [1.0, 1.0, 1.0, 0.0, 0.0])
    w, _, masked = run("geo_mask", low=0.5, high=1.1)
    close(w, [0.0, 0.0, 0.0, 1.0, 1.0])
    assert masked == [True, True, True, False, False]


# TRL 1.16's own OPSM function on the same batch, padded to [2, 3], under a Python with trl installed:
#   from trl.trainer.grpo_trainer import GRPOTrainer
#   beh = [[-1, -2, -1.5], [-0.5, -3, 0]]; cur = beh + [[ln 3, ln 0.5, 0], [ln 0.25, ln 1.5, 0]]  (float64 tensors)
#   mask = [[1, 1, 1], [1, 1, 0]]
#   GRPOTrainer.get_off_policy_mask(tensor(adv).unsqueeze(1), cur, beh, mask, delta).flatten().tolist()
# printed, per (advantages, delta), the keep flag of each sequence:
TRL_OPSM = {((1.0, -1.0), 0.1): [1.0, 0.0], ((1.0, -1.0), 0.4): [1.0, 0.0], ((1.0, -1.0), 0.6): [1.0, 1.0],
            ((-1.0, 1.0), 0.1): [1.0, 1.0], ((-1.0, 1.0), 0.4): [1.0, 1.0], ((-1.0, 1.0), 0.6): [1.0, 1.0],
            ((-1.0, -1.0), 0.1): [1.0, 0.0], ((-1.0, -1.0), 0.4): [1.0, 0.0], ((-1.0, -1.0), 0.6): [1.0, 1.0]}


@pytest.mark.parametrize("adv, delta", list(TRL_OPSM))
def test_opsm_drops_negative_advantage_sequences_far_from_the_trainer_and_matches_trl(adv, delta):
    # mean log(pi_behaviour / pi_trainer): sequence 0 = -ln(1.5) / 3 = -0.1352, sequence 1 = -ln(0.375) / 2 = 0.4904
    kl = [-math.log(1.5) / 3, -math.log(0.375) / 2]
    hand = [0.0 if adv[s] < 0 and kl[s] > delta else 1.0 for s in SEQ]
    w, _, masked = run("opsm", adv=adv, opsm_delta=delta)
    assert w == hand and masked == [x == 0.0 for x in hand]
    assert w == [TRL_OPSM[(adv, delta)][s] for s in SEQ]


def test_m2po_masks_the_largest_squared_log_ratios_of_the_trust_region_until_their_mean_is_at_most_tau():
    """M2PO's Algorithm 1 (arXiv 2510.01161): the candidates are the trust-region tokens, where PPO's clip could act.
    With A = (+1, -1): sequence 0's r = 3 (A > 0, r > 1: in), 0.5 and 1 (out); sequence 1's r = 0.25 (A < 0, r < 1:
    in), 1.5 (out). (ln r)^2 of t0 = 1.2069, t3 = 1.9218: mean 1.5644; without t3, 1.2069; then none left."""
    sq = [math.log(r) ** 2 for r in R]
    assert (sq[0] + sq[3]) / 2 == pytest.approx(1.5644, abs=1e-4) and sq[0] == pytest.approx(1.2069, abs=1e-4)
    both, t0 = (sq[0] + sq[3]) / 2, sq[0]                  # at exactly tau nothing more goes (Algorithm 1's ">")
    for tau, dropped in ((2.0, []), (both, []), (1.5, [3]), (t0, [3]), (1.2, [3, 0]), (0.04, [3, 0])):
        w, _, masked = run("m2po", m2po_tau=tau)
        assert [i for i in range(5) if masked[i]] == sorted(dropped), tau
        close(w, [0.0 if i in dropped else 1.0 for i in range(5)])
    # the other advantage signs move the region: A = (-1, +1) takes r = 0.5 (t1) and r = 1.5 (t4)
    w, _, masked = run("m2po", adv=(-1.0, 1.0), m2po_tau=0.1)       # (ln 0.5)^2 = 0.4805, (ln 1.5)^2 = 0.1644
    assert [i for i in range(5) if masked[i]] == [1, 4]             # 0.3224 > 0.1, then 0.1644 > 0.1: both go


def test_m2po_over_every_token_masks_the_largest_squared_log_ratios_until_the_mean_is_at_most_tau():
    # m2po_tokens = "all" (AReaL's apply_m2po_masking): (ln r)^2 = [1.2069, 0.4805, 0, 1.9218, 0.1644]; sorted
    # descending: t3, t0, t1, t4, t2. Means of what is left after masking the first k: k=0 0.7547, k=1 0.4630,
    # k=2 0.2150, k=3 0.0822, k=4 0.0
    sq = [math.log(r) ** 2 for r in R]
    order = [3, 0, 1, 4, 2]
    rest = [sum(sq[i] for i in order[k:]) / (5 - k) for k in range(5)]
    assert rest == pytest.approx([0.75472, 0.46295, 0.21495, 0.08220, 0.0], abs=1e-4)
    for tau, dropped in ((1.0, []), (0.5, [3]), (0.1, [3, 0, 1]), (0.04, [3, 0, 1, 4]), (rest[2], [3, 0])):
        w, _, masked = run("m2po", m2po_tau=tau, m2po_tokens="all")
        assert [i for i in range(5) if masked[i]] == sorted(dropped), tau
        close(w, [0.0 if i in dropped else 1.0 for i in range(5)])


def test_m2po_when_no_set_gets_there_and_untrained_tokens():
    lr = torch.tensor([1.0, -1.0, 1.0, 5.0], dtype=D)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=D)  # the 5.0 is not trained: it must not count anywhere
    keep = m2po_keep(lr, mask, tau=0.5, tokens="all")  # every (ln r)^2 is 1 > 0.5: AReaL masks all but one
    assert int(keep.sum()) == 1 and not keep[3]
    keep = m2po_keep(lr, mask, tau=1.5, tokens="all")  # the mean of the trained ones is 1 <= 1.5: nothing masked
    assert keep.tolist() == [True, True, True, False]
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0], dtype=D)   # trust region: t0 only (A > 0, r > 1); t1, t2 outside
    keep = m2po_keep(lr, mask, tau=0.5, advantages=adv)  # its (ln r)^2 = 1 > 0.5: Algorithm 1 masks it, T empties
    assert keep.tolist() == [False, True, True, False]
    assert not m2po_keep(lr, torch.zeros(4, dtype=D), tau=0.5, advantages=adv).any()  # a dummy micro-batch
    with pytest.raises(ValueError, match="needs the advantages"):
        m2po_keep(lr, mask, tau=0.5)
    with pytest.raises(ValueError, match="m2po_tokens"):
        Correction("m2po", m2po_tokens="some")
    with pytest.raises(ValueError, match="m2po_scope"):
        Correction("m2po", m2po_scope="rank")
    # a keep ranked over a larger batch (m2po_scope = "batch", by the trainer) replaces these tokens' own ranking
    given = torch.tensor([True, False, True, True])
    out = correct(Correction("m2po", m2po_tau=0.5), lr, adv, torch.zeros(4, dtype=torch.long), mask, 1, keep=given)
    assert out.masked.tolist() == [False, True, False, False] and out.weight.tolist() == [1.0, 0.0, 1.0, 1.0]


def trl_is(mode, lr, cmin, cmax):
    """TRL's vLLM importance-sampling weight per its documented definition (trl/trainer/grpo_config.py,
    `vllm_importance_sampling_mode`) on a padded [B, T] batch: token_* per token, sequence_* one ratio per sequence
    (the exponentiated sum of the token log ratios); *_truncate clamps to [C_min, C_max], *_mask sets a ratio
    outside them to 0."""
    pad_lr = torch.tensor([[lr[0], lr[1], lr[2]], [lr[3], lr[4], 0.0]], dtype=D)
    pad_mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
    diff = pad_lr * pad_mask
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=cmin, max=cmax)
    else:
        ratio = ratio.masked_fill((ratio < (cmin or -math.inf)) | (ratio > cmax), 0.0)
    ratio = ratio.expand(2, 3)
    return [ratio[0, 0], ratio[0, 1], ratio[0, 2], ratio[1, 0], ratio[1, 1]]


@pytest.mark.parametrize("ours, trl", [("tis", "token_truncate"), ("token_mask", "token_mask"),
                                       ("seq_tis", "sequence_truncate"), ("seq_mask", "sequence_mask")])
@pytest.mark.parametrize("low, high", [(0.0, 3.0), (0.4, 2.0), (0.3, 1.2)])
def test_is_weights_equal_trls_vllm_importance_sampling_modes(ours, trl, low, high):
    lr = [math.log(r) for r in R]
    w, _, _ = run(ours, low=low, high=high)
    close(w, [float(x) for x in trl_is(trl, lr, low or None, high)])


def test_mismatch_sums_hand_computed_and_by_staleness_bucket():
    # k3 = r - 1 - ln r: [3 - 1 - ln 3, 0.5 - 1 + ln 2, 0, 0.25 - 1 + ln 4, 1.5 - 1 - ln 1.5]
    k3 = [2 - math.log(3), -0.5 + math.log(2), 0.0, -0.75 + math.log(4), 0.5 - math.log(1.5)]
    _, lr, _, _, mask = tensors()
    stale = torch.tensor([0, 1, 2, 3, 5])
    sums, r_max = mismatch_sums(lr, mask, stale)
    assert float(sums["mismatch_kl_k3"]) == pytest.approx(sum(k3), abs=1e-12)
    assert float(sums["mismatch_ratio_mean"]) == pytest.approx(sum(R), abs=1e-12) and float(r_max) == pytest.approx(3.0)
    assert float(sums["mismatch_kl_k3_stale0"]) == pytest.approx(k3[0]) and float(sums["tokens_stale0"]) == 1
    assert float(sums["mismatch_kl_k3_stale1"]) == pytest.approx(k3[1]) and float(sums["tokens_stale1"]) == 1
    assert float(sums["mismatch_kl_k3_stale2_3"]) == pytest.approx(k3[2] + k3[3])
    assert float(sums["tokens_stale2_3"]) == 2
    assert float(sums["mismatch_kl_k3_stale4plus"]) == pytest.approx(k3[4]) and float(sums["tokens_stale4plus"]) == 1
    sums, r_max = mismatch_sums(lr, torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0], dtype=D))  # the 1.5 untrained
    assert float(sums["mismatch_ratio_mean"]) == pytest.approx(4.75) and "tokens_stale0" not in sums


def test_mismatch_kl_is_kl_of_behaviour_from_trainer_in_expectation():
    """Weighting each outcome by its behaviour probability (the mask as p), the k3 sum is exactly KL(p || q): the
    direction the metric claims. The reverse direction gives a different number on this pair."""
    p = torch.tensor([0.9, 0.05, 0.05], dtype=D)  # behaviour
    q = torch.tensor([0.3, 0.3, 0.4], dtype=D)    # trainer
    sums, _ = mismatch_sums(q.log() - p.log(), p)
    kl_pq, kl_qp = float((p * (p / q).log()).sum()), float((q * (q / p).log()).sum())
    assert float(sums["mismatch_kl_k3"]) == pytest.approx(kl_pq, abs=1e-12)
    assert abs(kl_pq - kl_qp) > 0.2


def loss_batch():
    beh, lr, seq_idx, adv, mask = tensors()
    trainer = beh + lr
    return beh, trainer, seq_idx, adv, mask


@pytest.mark.parametrize("kind", ["tis", "token_mask", "seq_tis", "seq_mask"])
def test_a_weighting_correction_on_the_behaviour_path_takes_the_ratio_against_the_trainer(kind):
    """One optimizer step per call: logp == pi_trainer, so the PPO ratio is 1 (unclipped) and, token_mean,
    d loss / d logp_t = -A_t w_t / N: the weight alone carries the correction (r_t is not counted twice)."""
    beh, trainer, seq_idx, adv, mask = loss_batch()
    c = Correction(kind, low=0.4, high=2.0)
    logp = trainer.clone().requires_grad_()
    out = policy_loss(logp, beh, adv, seq_idx, mask, correction=c)
    (g,) = torch.autograd.grad(out.loss, logp)
    w = torch.tensor(run(kind, low=0.4, high=2.0)[0], dtype=D)
    assert torch.allclose(g, -adv * w / 5, atol=1e-12)
    assert float(out.loss.detach()) == pytest.approx(float((-adv * w).sum() / 5), abs=1e-12)
    m = out.metrics()
    assert m["correction_weight_mean"] == pytest.approx(float(w.mean()))


@pytest.mark.parametrize("kind, kw", [("geo_mask", dict(low=0.7, high=2.0)), ("opsm", dict(opsm_delta=0.4)),
                                      ("m2po", dict(m2po_tau=0.1))])
def test_a_rejection_correction_keeps_the_behaviour_ratio_and_zeroes_the_dropped_tokens(kind, kw):
    """pg_t = w_t * max(-A r_t, -A clip(r_t, 0.8, 1.2)) with r_t = pi_trainer / pi_behaviour (logp == trainer)."""
    beh, trainer, seq_idx, adv, mask = loss_batch()
    logp = trainer.clone().requires_grad_()
    out = policy_loss(logp, beh, adv, seq_idx, mask, correction=Correction(kind, **kw))
    w = torch.tensor(run(kind, **kw)[0], dtype=D)
    r = torch.tensor(R, dtype=D)
    hand = (w * torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))).sum() / 5
    assert float(out.loss.detach()) == pytest.approx(float(hand), abs=1e-12)
    assert out.metrics()["correction_masked_frac"] == pytest.approx(float((w == 0).double().mean()))


def test_on_the_decoupled_path_tis_and_token_mask_equal_the_is_cap_weight():
    """tis with high = is_cap is the clamp mode, token_mask with [0, is_cap] AReaL's mask mode: the same numbers."""
    beh, trainer, seq_idx, adv, mask = loss_batch()
    logp = (trainer + 0.1 * torch.randn(5, dtype=D, generator=torch.Generator().manual_seed(0))).requires_grad_()
    for kind, mode in (("tis", "clamp"), ("token_mask", "mask")):
        new = policy_loss(logp, beh, adv, seq_idx, mask, prox_logp=trainer, correction=Correction(kind, high=2.0))
        old = policy_loss(logp, beh, adv, seq_idx, mask, prox_logp=trainer, is_cap=2.0, is_mode=mode)
        g_new, g_old = (torch.autograd.grad(o.loss, logp)[0] for o in (new, old))
        assert torch.equal(new.loss, old.loss) and torch.equal(g_new, g_old)


@pytest.mark.parametrize("prox", [False, True])
def test_correction_none_with_the_new_inputs_is_the_loss_bit_for_bit(prox):
    beh, trainer, seq_idx, adv, mask = loss_batch()
    logp = (trainer + 0.3).requires_grad_()
    kw = dict(prox_logp=trainer, is_cap=2.0) if prox else {}
    plain = policy_loss(logp, beh, adv, seq_idx, mask, **kw)
    more = policy_loss(logp, beh, adv, seq_idx, mask, trainer_logp=trainer - 1, correction=Correction("none"),
                       staleness=torch.arange(5), **kw)
    g_plain, g_more = (torch.autograd.grad(o.loss, logp)[0] for o in (plain, more))
    assert torch.equal(plain.loss, more.loss) and torch.equal(g_plain, g_more)
    assert all(torch.equal(plain.sums[k], more.sums[k]) for k in plain.sums if not k.startswith("mismatch"))


def test_corrections_carry_no_gradient_and_bad_values_are_errors():
    beh, trainer, seq_idx, adv, mask = loss_batch()
    for kind in CORRECTIONS:
        tl = trainer.clone().requires_grad_()
        logp = (trainer + 0.05).requires_grad_()
        out = policy_loss(logp, beh, adv, seq_idx, mask, trainer_logp=tl, correction=Correction(kind))
        g_logp, g_tl = torch.autograd.grad(out.loss, [logp, tl], allow_unused=True)
        assert g_tl is None, kind
    with pytest.raises(ValueError, match="correction 'ice'"):
        Correction("ice")
    with pytest.raises(ValueError, match="low < high"):
        Correction("tis", low=2.0, high=2.0)

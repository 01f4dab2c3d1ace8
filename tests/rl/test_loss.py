"""rl/loss.py and rl/advantages.py against the formulas written out plainly: loops over sequences and tokens."""
import itertools
import math

import pytest
import torch

from rl.advantages import compute_advantages, group_advantages
from rl.loss import policy_loss
from rl.types import Group, Trajectory

LENS = [3, 5, 1, 4]
MASKS = [[0, 1, 1], [0, 0, 1, 1, 1], [1], [1, 1, 0, 1]]  # a zero in the middle too: the mask is the only truth
ADVS = [1.3, -0.7, 0.4, -1.1]
MAX_LEN = 6


def batch(seed=1, spread=0.5):  # seed 1: both clip sides hit, at both ratio levels, for both clip ranges
    g = torch.Generator().manual_seed(seed)
    n = sum(LENS)
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    new = (old + spread * torch.randn(n, generator=g, dtype=torch.float64)).requires_grad_()
    ref = old + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    seq_idx = torch.repeat_interleave(torch.arange(len(LENS)), torch.tensor(LENS))
    adv = torch.tensor(ADVS, dtype=torch.float64)[seq_idx]
    mask = torch.tensor(sum(MASKS, []), dtype=torch.float64)
    return new, old, ref, adv, seq_idx, mask


def direct_loss(new, old, ref, agg, ratio_level, clip_low, clip_high, kl_coef, ppo_clip=True):
    """The same objective, one sequence and one token at a time. The GSPO ratio here is the sequence ratio
    itself, s_i = exp(mean(logp - old)), fully differentiable (the paper's sequence-level objective)."""
    per_seq, n_tokens, start = [], 0, 0
    for i, (length, m) in enumerate(zip(LENS, MASKS)):
        toks = [start + t for t in range(length) if m[t]]
        s = torch.exp(sum(new[t] - old[t] for t in toks) / len(toks))
        terms = []
        for t in toks:
            r = torch.exp(new[t] - old[t]) if ratio_level == "token" else s
            a = ADVS[i]
            pg = torch.max(-a * r, -a * torch.clamp(r, 1 - clip_low, 1 + clip_high)) if ppo_clip else -a * r
            d = ref[t] - new[t]
            kl = torch.exp(d) - d - 1
            terms.append(pg + kl_coef * kl)
        per_seq.append(terms)
        n_tokens += len(toks)
        start += length
    if agg == "token_mean":
        return sum(sum(ts) for ts in per_seq) / n_tokens
    if agg == "seq_mean":
        return sum(sum(ts) / len(ts) for ts in per_seq) / len(per_seq)
    return sum(sum(ts) / MAX_LEN for ts in per_seq) / len(per_seq)


CASES = list(itertools.product(["token_mean", "seq_mean", "seq_sum_norm"], ["token", "sequence"],
                               [0.0, 0.1], [(0.2, 0.2), (0.2, 0.28)]))


@pytest.mark.parametrize("agg,ratio_level,kl_coef,clip", CASES)
def test_loss_and_grads_match_direct_formula(agg, ratio_level, kl_coef, clip):
    new, old, ref, adv, seq_idx, mask = batch()
    kw = dict(clip_low=clip[0], clip_high=clip[1], loss_agg=agg, ratio_level=ratio_level, kl_coef=kl_coef,
              max_len=MAX_LEN)
    out = policy_loss(new, old, adv, seq_idx, mask, ref if kl_coef else None, **kw)
    (g_ours,) = torch.autograd.grad(out.loss, new)
    ref_loss = direct_loss(new, old, ref, agg, ratio_level, clip[0], clip[1], kl_coef)
    (g_ref,) = torch.autograd.grad(ref_loss, new)
    assert torch.allclose(out.loss, ref_loss, atol=1e-12, rtol=1e-10)
    assert torch.allclose(g_ours, g_ref, atol=1e-12, rtol=1e-10)
    assert (g_ours[mask == 0] == 0).all()
    assert out.num_tokens == int(mask.sum())


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "seq_sum_norm"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_without_the_ppo_clip_loss_and_grads_match_the_unclipped_formula(agg, ratio_level):
    """clip=False (train.ppo_clip = false; M2PO's objective, arXiv 2510.01161 Eq. 5): pg = -A r on every token, so
    the batch whose ratios leave the clip range on both sides gets a different loss and gradient than with it."""
    new, old, ref, adv, seq_idx, mask = batch()
    kw = dict(clip_low=0.2, clip_high=0.28, loss_agg=agg, ratio_level=ratio_level, max_len=MAX_LEN)
    out = policy_loss(new, old, adv, seq_idx, mask, clip=False, **kw)
    (g_ours,) = torch.autograd.grad(out.loss, new)
    ref_loss = direct_loss(new, old, ref, agg, ratio_level, 0.2, 0.28, 0.0, ppo_clip=False)
    (g_ref,) = torch.autograd.grad(ref_loss, new)
    assert torch.allclose(out.loss, ref_loss, atol=1e-12, rtol=1e-10)
    assert torch.allclose(g_ours, g_ref, atol=1e-12, rtol=1e-10)
    (g_clipped,) = torch.autograd.grad(policy_loss(new, old, adv, seq_idx, mask, **kw).loss, new)
    assert not torch.allclose(g_ours, g_clipped)
    assert (g_ours[mask > 0] != 0).all() and (g_clipped[mask > 0] == 0).any()


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.2, 0.28)])
def test_the_fixed_batch_clips_on_both_sides_but_not_everywhere(ratio_level, clip):
    new, old, ref, adv, seq_idx, mask = batch()
    m = policy_loss(new, old, adv, seq_idx, mask, clip_low=clip[0], clip_high=clip[1],
                    ratio_level=ratio_level).metrics()
    assert 0 < m["clip_frac_low"] and 0 < m["clip_frac_high"] and m["clip_frac_low"] + m["clip_frac_high"] < 1


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("log_ratio,adv,clipped", [(2.0, 1.0, True), (2.0, -1.0, False),
                                                   (-2.0, -1.0, True), (-2.0, 1.0, False)])
def test_clipping_zeroes_the_gradient_on_the_clipped_side(ratio_level, log_ratio, adv, clipped):
    old = torch.full((6,), -1.0, dtype=torch.float64)
    new = (old + log_ratio).requires_grad_()
    seq_idx = torch.tensor([0, 0, 0, 1, 1, 1])
    out = policy_loss(new, old, torch.full((6,), adv, dtype=torch.float64), seq_idx, clip_low=0.2, clip_high=0.28,
                      ratio_level=ratio_level)
    (g,) = torch.autograd.grad(out.loss, new)
    m = out.metrics()
    if clipped:
        assert (g == 0).all()
        assert m["clip_frac_high" if log_ratio > 0 else "clip_frac_low"] == 1.0
    else:  # the unclipped term is the larger loss: PPO keeps its gradient (pushes the ratio back)
        assert (g.abs() > 0).all()
        assert m["clip_frac_high"] == m["clip_frac_low"] == 0.0
    assert m["ratio_mean"] == pytest.approx(math.exp(log_ratio))


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "seq_sum_norm"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_micro_batching_does_not_change_loss_or_gradients(agg, ratio_level):
    new, old, ref, adv, seq_idx, mask = batch(seed=3)
    kw = dict(clip_low=0.2, clip_high=0.28, loss_agg=agg, ratio_level=ratio_level, kl_coef=0.05, max_len=MAX_LEN)
    full = policy_loss(new, old, adv, seq_idx, mask, ref, **kw)
    (g_full,) = torch.autograd.grad(full.loss, new)
    normaliser = mask.sum() if agg == "token_mean" else len(LENS)
    cut = LENS[0] + LENS[1]
    total, sums = 0.0, {}
    for sl, first_seq in ((slice(0, cut), 0), (slice(cut, None), 2)):
        out = policy_loss(new[sl], old[sl], adv[sl], seq_idx[sl] - first_seq, mask[sl], ref[sl],
                          normaliser=float(normaliser), **kw)
        total = total + out.loss
        for k, v in out.sums.items():
            sums[k] = sums.get(k, 0) + v
    (g_micro,) = torch.autograd.grad(total, new)
    assert torch.allclose(total, full.loss, atol=1e-12)
    assert torch.allclose(g_micro, g_full, atol=1e-12)
    for k, v in full.sums.items():
        assert torch.allclose(sums[k], v, atol=1e-12), k


def test_argument_errors():
    new, old, ref, adv, seq_idx, mask = batch()
    with pytest.raises(ValueError, match="max_len"):
        policy_loss(new, old, adv, seq_idx, mask, loss_agg="seq_sum_norm")
    with pytest.raises(ValueError, match="loss_agg"):
        policy_loss(new, old, adv, seq_idx, mask, loss_agg="mean")
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(new, old, adv, seq_idx, mask, kl_coef=0.1)


# ---- decoupled PPO (train.off_policy = "decoupled") -------------------------------------------------------------
def direct_decoupled(new, old, prox, cap, agg, ratio_level, clip_low, clip_high):
    """Decoupled PPO written out per token: ratio against prox, times min(exp(prox - old), cap) (no KL). With
    per-token weights the sequence level is GSPO-token's (value s_i, gradient s_i * grad logp_t on token t): the
    fully differentiable s_i would spread each token's weight over its whole sequence."""
    per_seq, n_tokens, start = [], 0, 0
    for i, (length, m) in enumerate(zip(LENS, MASKS)):
        toks = [start + t for t in range(length) if m[t]]
        s = torch.exp(sum(new[t].detach() - prox[t] for t in toks) / len(toks))
        terms = []
        for t in toks:
            r = torch.exp(new[t] - prox[t]) if ratio_level == "token" else s * torch.exp(new[t] - new[t].detach())
            w = math.exp(float(prox[t] - old[t]))
            w = min(w, cap) if cap else w
            a = ADVS[i]
            terms.append(w * torch.max(-a * r, -a * torch.clamp(r, 1 - clip_low, 1 + clip_high)))
        per_seq.append(terms)
        n_tokens += len(toks)
        start += length
    if agg == "token_mean":
        return sum(sum(ts) for ts in per_seq) / n_tokens
    if agg == "seq_mean":
        return sum(sum(ts) / len(ts) for ts in per_seq) / len(per_seq)
    return sum(sum(ts) / MAX_LEN for ts in per_seq) / len(per_seq)


def proximal(old, seed=7, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    return old + spread * torch.randn(old.shape, generator=g, dtype=old.dtype)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "seq_sum_norm"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [0.0, 1.5])
def test_decoupled_loss_and_grads_match_direct_formula(agg, ratio_level, cap):
    new, old, _, adv, seq_idx, mask = batch()
    prox = proximal(old)
    out = policy_loss(new, old, adv, seq_idx, mask, clip_low=0.2, clip_high=0.28, loss_agg=agg,
                      ratio_level=ratio_level, max_len=MAX_LEN, prox_logp=prox, is_cap=cap)
    (g_ours,) = torch.autograd.grad(out.loss, new)
    want = direct_decoupled(new, old, prox, cap, agg, ratio_level, 0.2, 0.28)
    (g_want,) = torch.autograd.grad(want, new)
    assert torch.allclose(out.loss, want, atol=1e-12, rtol=1e-10)
    assert torch.allclose(g_ours, g_want, atol=1e-12, rtol=1e-10)
    assert (g_ours[mask == 0] == 0).all()
    plain = policy_loss(new, old, adv, seq_idx, mask, clip_low=0.2, clip_high=0.28, loss_agg=agg,
                        ratio_level=ratio_level, max_len=MAX_LEN)
    assert not torch.allclose(out.loss, plain.loss)  # the batch is off-policy enough for the correction to matter


def test_decoupled_gradient_is_the_hand_computed_one():
    """token_mean, token ratio: d loss / d logp_t = -A_t w_t r_t / N on tokens whose ratio is not clipped on the
    advantage's side, else 0, with r_t = exp(logp_t - prox_t) and w_t = min(exp(prox_t - old_t), cap)."""
    new, old, _, adv, seq_idx, mask = batch()
    prox, cap, lo, hi = proximal(old), 1.5, 0.2, 0.28
    out = policy_loss(new, old, adv, seq_idx, mask, clip_low=lo, clip_high=hi, prox_logp=prox, is_cap=cap)
    (g,) = torch.autograd.grad(out.loss, new)
    r = torch.exp(new.detach() - prox)
    w = torch.exp(prox - old).clamp(max=cap)
    clipped = ((adv > 0) & (r > 1 + hi)) | ((adv < 0) & (r < 1 - lo))
    hand = torch.where(clipped, torch.zeros_like(r), -adv * w * r) * mask / mask.sum()
    assert clipped[mask > 0].any() and (~clipped[mask > 0]).any()  # both branches exercised
    assert torch.allclose(g, hand, atol=1e-12)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_decoupled_equals_plain_loss_when_behaviour_is_proximal(ratio_level):
    """behaviour == proximal: w = 1 and the ratio's anchor is the same, so the objective is plain PPO. And with
    behaviour == current (one optimizer step per call, prox = detached current), the two agree as well."""
    new, old, ref, adv, seq_idx, mask = batch()
    kw = dict(clip_low=0.2, clip_high=0.28, ratio_level=ratio_level, kl_coef=0.1, loss_agg="seq_mean")
    for behaviour, logp in ((old, new), (new.detach().clone(), new)):
        plain = policy_loss(logp, behaviour, adv, seq_idx, mask, ref, **kw)
        dec = policy_loss(logp, behaviour, adv, seq_idx, mask, ref, prox_logp=behaviour.clone(), is_cap=2.0, **kw)
        (g_p,) = torch.autograd.grad(plain.loss, new)
        (g_d,) = torch.autograd.grad(dec.loss, new)
        assert torch.allclose(plain.loss, dec.loss, atol=1e-12) and torch.allclose(g_p, g_d, atol=1e-12)
        m = dec.metrics()
        assert m["is_weight_mean"] == pytest.approx(1.0) and m["is_truncated_frac"] == 0.0
        assert "is_weight_mean" not in plain.metrics()


def test_importance_weight_is_truncated_at_the_cap():
    old = torch.zeros(4, dtype=torch.float64)
    w_raw = torch.tensor([0.5, 1.5, 3.0, 10.0], dtype=torch.float64)
    prox = old + w_raw.log()
    new = prox.clone().requires_grad_()  # r = 1: unclipped, the gradient is -A * w / N per token
    adv, seq_idx = torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.long)
    for cap, mode, w in ((2.0, "clamp", [0.5, 1.5, 2.0, 2.0]), (0.0, "clamp", w_raw.tolist()),
                         (2.0, "mask", [0.5, 1.5, 0.0, 0.0]), (0.0, "mask", w_raw.tolist())):   # mask: AReaL's
        out = policy_loss(new, old, adv, seq_idx, prox_logp=prox, is_cap=cap, is_mode=mode)
        (g,) = torch.autograd.grad(out.loss, new)
        assert torch.allclose(g, -torch.tensor(w, dtype=torch.float64) / 4, atol=1e-12)
        m = out.metrics()
        assert m["is_weight_mean"] == pytest.approx(sum(w) / 4)
        assert m["is_truncated_frac"] == (0.5 if cap else 0.0)
    with pytest.raises(ValueError, match="is_cap"):
        policy_loss(new, old, adv, seq_idx, prox_logp=prox, is_cap=-1.0)
    with pytest.raises(ValueError, match="is_mode 'drop'"):
        policy_loss(new, old, adv, seq_idx, prox_logp=prox, is_cap=2.0, is_mode="drop")


def test_decoupled_weight_carries_no_gradient_to_the_proximal_logprobs():
    new, old, _, adv, seq_idx, mask = batch()
    prox = proximal(old).requires_grad_()
    out = policy_loss(new, old, adv, seq_idx, mask, prox_logp=prox, is_cap=2.0)
    g_new, g_prox = torch.autograd.grad(out.loss, [new, prox], allow_unused=True)
    assert g_prox is None and g_new.abs().sum() > 0


# ---- advantages ----------------------------------------------------------------------------------------------
def _group(gid, rewards):
    trajs = [Trajectory(gid, j, [1], [2], [0.0], [0], reward=r) for j, r in enumerate(rewards)]
    return Group(gid, gid, None, trajs)


def test_group_advantages_std_and_dr_grpo():
    r = [1.0, 0.0, 0.0, 1.0, 1.0]
    mean = sum(r) / len(r)
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
    assert group_advantages(r, "std") == pytest.approx([(x - mean) / (std + 1e-6) for x in r])
    assert group_advantages(r, "none") == pytest.approx([x - mean for x in r])
    assert group_advantages([0.5], "std") == [0.0]


def test_zero_variance_groups_are_filtered_and_counted():
    groups = [_group(0, [1, 1, 1]), _group(1, [0, 1, 0]), _group(2, [0, 0, 0]), _group(3, [0.2, 0.7, 0.2])]
    res = compute_advantages(groups, "none", filter_zero_variance=True)
    assert [g.group_id for g in res.groups] == [1, 3]
    assert res.num_filtered == 2 and res.num_groups == 4
    assert res.advantages[0] == pytest.approx([-1 / 3, 2 / 3, -1 / 3])
    kept_all = compute_advantages(groups, "std", filter_zero_variance=False)
    assert len(kept_all.groups) == 4 and kept_all.num_filtered == 0
    assert kept_all.advantages[0] == [0.0, 0.0, 0.0]

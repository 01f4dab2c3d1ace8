"""Multi-turn trajectories' loss mask through the trainer: observation tokens stay in the packed input (they
condition later model tokens) but are in no loss term, gradient, normaliser or statistic; shared-prompt packing
agrees with unshared packing; the mask survives the controller's checkpoint."""
import math

import pytest
import torch

import sched
from config import TrainConfig
from model import cu_seqlens_from_lengths
from rl.advantages import compute_advantages
from rl.correction import Correction
from rl.loss import policy_loss
from rl.types import Group, Trajectory
from sched.views import Request, RequestState
from trainer import Trainer, checkpoint
from trainer.batch import build_samples, collate
from tests.support.fake_backend import FakeBackend, RecordingController, source
from tests.support.trainer import SMOOTH_ADAM, VOCAB, tiny_model, weights

pytestmark = pytest.mark.usefixtures("one_thread")


def episode(g: torch.Generator, turns: int) -> tuple[list[int], list[int]]:
    """Random response ids and mask: `turns` model turns of 1-4 tokens, observations of 1-3 tokens between them."""
    ids, mask = [], []
    for k in range(turns):
        n = int(torch.randint(1, 5, (1,), generator=g))
        ids += torch.randint(3, VOCAB, (n,), generator=g).tolist()
        mask += [1] * n
        if k < turns - 1:
            m = int(torch.randint(1, 4, (1,), generator=g))
            ids += torch.randint(3, VOCAB, (m,), generator=g).tolist()
            mask += [0] * m
    return ids, mask


def multi_turn_groups(seed: int, n_groups: int = 3, group_size: int = 4, obs_logprob=0.0, obs_version: int = 0,
                      single: bool = False) -> list[Group]:
    """Groups of multi-turn trajectories (1-3 turns; with `single` one sample per group has no mask at all), the
    observation tokens' behaviour log-prob `obs_logprob` (a value, or a callable of the token index) and version."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(n_groups):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        trajs = []
        for j in range(group_size):
            ids, mask = episode(g, int(torch.randint(1, 4, (1,), generator=g)))
            lps = (-math.log(VOCAB) + 0.3 * torch.randn(len(ids), generator=g)).tolist()
            lps = [lp if m else (obs_logprob(i) if callable(obs_logprob) else obs_logprob)
                   for i, (lp, m) in enumerate(zip(lps, mask))]
            versions = [0 if m else obs_version for m in mask]
            unmasked = single and j == 0
            if unmasked:
                lps = (-math.log(VOCAB) + 0.3 * torch.randn(len(ids), generator=g)).tolist()
            trajs.append(Trajectory(gi, j, prompt, ids, lps, versions, reward=float(torch.rand(1, generator=g)),
                                    loss_mask=None if unmasked else mask))
        groups.append(Group(seed * 100 + gi, gi, None, trajs))
    return groups


# ---- the reference, by hand: one forward per trajectory, observation positions dropped --------------------------
def reference_loss(model, groups, loss_agg="token_mean", ratio_level="token", clip=(0.2, 0.28), corr=None,
                   max_len=12):
    """The GRPO loss written out directly on the model tokens of each trajectory, each run through the model alone
    (no packing, no masks): the positions of observation tokens are simply not selected."""
    adv = compute_advantages(groups, "std")
    per_seq, n_tokens = [], 0
    for group, advantages in zip(adv.groups, adv.advantages):
        for t, a in zip(group.trajectories, advantages):
            seq = torch.tensor(t.prompt_ids + t.response_ids[:-1])
            logits = model.forward_packed(seq, cu_seqlens_from_lengths([len(seq)]))[len(t.prompt_ids) - 1:]
            logp_all = logits.log_softmax(-1).gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0]
            keep = [i for i, m in enumerate(t.loss_mask or [1] * len(t.response_ids)) if m]
            logp = logp_all[keep]
            old = torch.tensor([t.logprobs[i] for i in keep])
            anchor = logp.detach() if corr in ("tis", "seq_tis") else old
            if ratio_level == "token":
                ratio = torch.exp(logp - anchor)
            else:
                ratio = torch.exp((logp.detach() - anchor).mean()) * torch.exp(logp - logp.detach())
            pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip[0], 1 + clip[1]))
            if corr == "tis":
                pg = pg * torch.exp(logp.detach() - old).clamp(max=2.0)
            elif corr == "seq_tis":
                pg = pg * torch.exp((logp.detach() - old).sum()).clamp(max=2.0)
            elif corr == "geo_mask":
                geo = torch.exp((logp.detach() - old).mean())
                pg = pg * float(0.9 <= geo <= 1.1)
            per_seq.append(pg)
            n_tokens += len(keep)
    if loss_agg == "token_mean":
        return sum(p.sum() for p in per_seq) / n_tokens
    if loss_agg == "seq_mean":
        return sum(p.mean() for p in per_seq) / len(per_seq)
    return sum(p.sum() / max_len for p in per_seq) / len(per_seq)


CASES = [dict(), dict(loss_agg="seq_mean"), dict(loss_agg="seq_sum_norm"), dict(ratio_level="sequence"),
         dict(loss_agg="seq_mean", ratio_level="sequence"), dict(correction="tis"), dict(correction="seq_tis"),
         dict(correction="geo_mask", correction_low=0.9, correction_high=1.1), dict(share_prompts=False),
         dict(micro_batch_tokens=12)]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_masked_loss_and_every_gradient_equal_the_reference_without_the_observation_positions(kw):
    groups = multi_turn_groups(1, single=True)
    tr = Trainer(tiny_model(), TrainConfig(lr=1e-2, clip_high=0.28, **kw), max_response_len=12, fused_kernels=False)
    m = tr.train_step(groups, step=False)          # gradients accumulated, not applied
    ref_model = tiny_model()
    loss = reference_loss(ref_model, groups, kw.get("loss_agg", "token_mean"), kw.get("ratio_level", "token"),
                          corr=kw.get("correction"))
    loss.backward()
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    got = {n: p.grad for n, p in tr.model.named_parameters()}
    for n, p in ref_model.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-4, atol=1e-7), (n, (got[n] - p.grad).abs().max())
    model_tokens = sum(sum(t.loss_mask or [1] * len(t.response_ids)) for g in groups for t in g.trajectories)
    all_tokens = sum(len(t.response_ids) for g in groups for t in g.trajectories)
    assert m["tokens"] == model_tokens < all_tokens


def test_the_mask_really_removes_terms_a_mask_of_ones_would_train():
    """Guards the reference test: training the observation tokens too (all-ones masks) gives another gradient."""
    groups = multi_turn_groups(2)
    ones = multi_turn_groups(2)
    for g in ones:
        for t in g.trajectories:
            t.loss_mask = [1] * len(t.response_ids)
    grads = []
    for gs in (groups, ones):
        tr = Trainer(tiny_model(), TrainConfig(lr=1e-2), fused_kernels=False)
        tr.train_step(gs, step=False)
        grads.append(torch.cat([p.grad.flatten() for p in tr.model.parameters()]))
    assert (grads[0] - grads[1]).abs().max() > 1e-4


GARBAGE = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 7.0]
STEP_CASES = [dict(), dict(loss_agg="seq_mean", ratio_level="sequence"), dict(off_policy="decoupled", minibatches=2),
              dict(correction="tis", minibatches=2), dict(correction="m2po"), dict(correction="seq_mask"),
              dict(correction="opsm"), dict(kl_coef=0.1), dict(share_prompts=False)]


@pytest.mark.parametrize("kw", STEP_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_observation_log_probs_and_versions_are_never_read(kw):
    """What an observation token's entries of the trajectory say (behaviour log-prob: NaN, inf, huge; version)
    changes nothing: the same loss, metrics and updated weights, bit for bit. (Its token id does matter: it is
    input to every later model token, see the next test.)"""
    runs = []
    for obs_lp, obs_v in ((0.0, 0), (lambda i: GARBAGE[i % len(GARBAGE)], -40)):
        ref = tiny_model(seed=3) if kw.get("kl_coef") else None
        tr = Trainer(tiny_model(), TrainConfig(lr=1e-2, **kw), ref_model=ref, fused_kernels=False)
        ms = [tr.train_step(multi_turn_groups(s, obs_logprob=obs_lp, obs_version=obs_v)) for s in (4, 5)]
        for m in ms:
            for k in [k for k in m if k.endswith("_s")]:
                m.pop(k)
            assert all(math.isfinite(v) for v in m.values()), m
        runs.append((ms, weights(tr.model)))
    assert runs[0][0] == runs[1][0]
    for n, w in runs[0][1].items():
        assert torch.equal(w, runs[1][1][n]), n


def test_observation_tokens_still_condition_the_later_model_tokens():
    """Not invariant, and must not be: replacing an observation's token ids changes the log-prob of the model tokens
    after it (and so the gradient), while the model tokens before it are untouched."""
    ids, mask = [5, 6, 7, 8, 9, 10, 11], [1, 1, 0, 0, 1, 1, 1]
    t = Trajectory(0, 0, [3, 4], ids, [-4.0, -4.0, 0.0, 0.0, -4.0, -4.0, -4.0], [0] * 7, reward=1.0, loss_mask=mask)
    groups = [Group(0, 0, None, [t])]
    model = tiny_model()
    lps = []
    for obs in ([7, 8], [40, 41]):
        t.response_ids = ids[:2] + obs + ids[4:]
        b = collate(build_samples(compute_advantages(groups, "none", False)))
        assert b.input_ids.tolist() == [3, 4] + t.response_ids[:-1]     # the observation is input
        hidden = model(b.input_ids, b.positions, b.attn).index_select(0, b.loss_index)
        lps.append((hidden @ model.lm_head.weight.T).log_softmax(-1).gather(-1, b.targets[:, None])[:, 0])
        assert b.mask.tolist() == [1, 1, 0, 0, 1, 1, 1]
    assert torch.equal(lps[0][:2], lps[1][:2])
    assert (lps[0][4:] - lps[1][4:]).abs().min() > 1e-6


@pytest.mark.parametrize("budget", [10_000, 11])
def test_shared_prompt_packing_with_masks_equals_unshared_packing(budget):
    groups = multi_turn_groups(7, n_groups=4, group_size=5, single=True)
    samples = build_samples(compute_advantages(groups, "std"))
    model = tiny_model()
    rows = []
    for share in (False, True):
        b = collate(samples, share_prompts=share)
        hidden = model(b.input_ids, b.positions, b.attn).index_select(0, b.loss_index)
        lp = (hidden @ model.lm_head.weight.T).log_softmax(-1).gather(-1, b.targets[:, None])[:, 0]
        # (sequence, old log-prob, mask) identify a target; the shared packing reorders sequences by family
        key = [(samples.index(s), o) for s in _order(samples, share) for o in s.old_logprobs]
        rows.append(sorted(zip(key, b.mask.tolist(), lp.tolist())))
        assert b.mask.sum() == sum(s.num_trained for s in samples)
    assert [(k, m) for k, m, _ in rows[0]] == [(k, m) for k, m, _ in rows[1]]
    assert max(abs(x - y) for (_, _, x), (_, _, y) in zip(*rows)) < 1e-5
    out = []
    for share in (False, True):
        tr = Trainer(tiny_model(), TrainConfig(lr=1e-2, micro_batch_tokens=budget, share_prompts=share, **SMOOTH_ADAM),
                     fused_kernels=False)
        m = tr.train_step(groups)
        out.append((m, weights(tr.model)))
    assert out[0][0]["loss"] == pytest.approx(out[1][0]["loss"], rel=1e-5, abs=1e-7)
    assert out[0][0]["tokens"] == out[1][0]["tokens"]
    for n, w in out[0][1].items():
        assert torch.allclose(w, out[1][1][n], atol=1e-5), n


def _order(samples, share):
    from trainer.batch import prompt_families
    return [samples[i] for fam in prompt_families(samples) for i in fam] if share else samples


def test_policy_loss_with_a_mask_equals_policy_loss_on_the_model_tokens_alone():
    """The loss function itself, on small tensors: masked = the same call on the kept positions only, for every
    aggregation, GSPO and the sequence-level corrections (normaliser of the batch alone)."""
    g = torch.Generator().manual_seed(0)
    n = 14
    logp = (-2 + 0.5 * torch.randn(n, generator=g)).requires_grad_()
    old = -2 + 0.5 * torch.randn(n, generator=g)
    seq = torch.tensor([0] * 5 + [1] * 6 + [2] * 3)
    adv = torch.tensor([0.7, -1.2, 0.4])[seq]
    mask = torch.tensor([1, 1, 0, 0, 1, 1, 0, 1, 1, 0, 1, 0, 1, 1], dtype=torch.float32)
    keep = mask.bool()
    old_garbage = torch.where(keep, old, torch.full_like(old, float("nan")))
    for kw in (dict(), dict(loss_agg="seq_mean"), dict(loss_agg="seq_sum_norm", max_len=6),
               dict(ratio_level="sequence"), dict(correction=Correction("seq_tis", 0.5, 1.5)),
               dict(correction=Correction("opsm", opsm_delta=0.1)), dict(correction=Correction("m2po", m2po_tau=0.05)),
               dict(correction=Correction("geo_mask", 0.8, 1.25))):
        a = policy_loss(logp, old_garbage, adv, seq, mask, num_seqs=3, **kw)
        (ga,) = torch.autograd.grad(a.loss, logp)
        sub = logp[keep]
        b = policy_loss(sub, old[keep], adv[keep], seq[keep], None, num_seqs=3, **kw)
        (gb,) = torch.autograd.grad(b.loss, logp)
        assert torch.allclose(a.loss, b.loss, atol=1e-7), kw
        assert torch.allclose(ga, gb, atol=1e-7) and (ga[~keep] == 0).all(), kw
        assert a.num_tokens == int(keep.sum()) and set(a.sums) == set(b.sums)
        for k in a.sums:
            assert torch.allclose(a.sums[k], b.sums[k], atol=1e-6, equal_nan=False), (kw, k)


def test_build_samples_names_a_mask_of_the_wrong_length_or_values():
    groups = multi_turn_groups(8, n_groups=1, group_size=2)
    t = groups[0].trajectories[1]
    good = list(t.loss_mask)
    t.loss_mask = good[:-1]
    with pytest.raises(ValueError, match=f"sample 1: loss_mask has {len(good) - 1} entries for {len(good)} response"):
        build_samples(compute_advantages(groups, "std"))
    t.loss_mask = [2] + good[1:]
    with pytest.raises(ValueError, match="sample 1: loss_mask entries must be 0 \\(observation\\) or 1"):
        build_samples(compute_advantages(groups, "std"))
    t.loss_mask = good
    s = build_samples(compute_advantages(groups, "std"))[1]
    assert s.loss_mask == good and s.num_trained == sum(good) and s.targets == t.response_ids


def test_staleness_counts_the_model_tokens_only():
    groups = multi_turn_groups(9, obs_version=-100)
    tr = Trainer(tiny_model(), TrainConfig(lr=1e-2), fused_kernels=False)
    assert tr.staleness(groups) == {"staleness_mean": 0.0, "staleness_max": 0.0}


# ---- checkpoints ----------------------------------------------------------------------------------------------
def test_multi_turn_trajectories_keep_their_mask_through_the_controllers_checkpoint(tmp_path):
    """A partial multi-turn trajectory (a request interrupted mid-episode) and a finished, scored one not yet
    trained go through Controller.state_dict, a checkpoint's side file (torch.load weights_only) and a fresh
    controller's load_state_dict with their masks, and train as masked samples after the resume."""
    backend = FakeBackend(1, 0)
    ctl = RecordingController(sched.load_preset("sync"), source(), group_size=2, prompts_per_step=2, total_steps=1)
    ctl.run(backend)
    backend.drain(ctl)
    done = [Trajectory(0, 0, [3, 4], [5, 6, 7, 8, 9], [-1.0, -1.0, 0.0, -2.0, -2.0], [0, 0, 1, 1, 1], "stop",
                       reward=1.0, loss_mask=[1, 1, 0, 1, 1])]
    partial = Trajectory(99, 1, [3, 4, 5], [7, 8, 9, 10, 11], [-1.0, -2.0, 0.0, 0.0, -1.5], [0, 0, 0, 0, 1],
                         finish_reason="interrupted", loss_mask=[1, 1, 0, 0, 1])
    ctl.v.requests[1000] = Request(1000, 99, 1, 0, ctl.v.round, 3, RequestState.PENDING, tokens=5, partial=partial)
    gs = next(iter(ctl.v.groups.values()))
    gs.trajectories, gs.consumed, gs.scored = [done[0]], False, 1
    path = checkpoint.save(tmp_path / "ckpt", 1, tiny_model(), extra={"controller": ctl.state_dict()})
    fresh = RecordingController(sched.load_preset("sync"), source(), group_size=2, prompts_per_step=2, total_steps=2)
    fresh.load_state_dict(checkpoint.read_extra(path)["controller"])
    back = fresh.v.requests[1000].partial
    assert back.loss_mask == [1, 1, 0, 0, 1] and back.response_ids == partial.response_ids
    assert fresh.v.requests[1000].state == RequestState.RESTORED and fresh.v.requests[1000].tokens == 5
    kept = fresh.v.groups[gs.group_id].trajectories[0]
    assert kept.loss_mask == done[0].loss_mask and 0 in kept.loss_mask
    kept2 = Trajectory(**{**kept.__dict__, "sample_index": 1})
    samples = build_samples(compute_advantages([Group(gs.group_id, 0, None, [kept, kept2])], "none", False))
    assert samples[0].loss_mask == done[0].loss_mask

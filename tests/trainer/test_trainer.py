"""The trainer in one process (no process group: unsharded): batching, schedule, activation checkpointing,
micro-batch invariance, on-policy ratio = 1, checkpoints, and a learning smoke test."""
import math

import pytest
import torch

from config import TrainConfig
from model import cu_seqlens_from_lengths
from rl.advantages import compute_advantages
from rl.types import Group, Trajectory
from trainer import Trainer
from trainer.batch import Sample, assign_to_ranks, build_samples, collate, pack_micro_batches, plan_micro_batches
from trainer.optim import lr_factor
from tests.support.trainer import SMOOTH_ADAM, VOCAB, make_groups, on_policy_groups, tiny_model, weights


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- batching ------------------------------------------------------------------------------------------------
def test_collate_aligns_targets_with_the_positions_that_predict_them():
    t = Trajectory(0, 0, [10, 11, 12], [20, 21], [-1.0, -2.0], [0, 0], reward=1.0)
    u = Trajectory(0, 1, [13], [22, 23, 24], [-3.0, -4.0, -5.0], [0, 0, 0], reward=0.0)
    samples = build_samples(compute_advantages([Group(0, 0, None, [t, u])], "none"))
    b = collate(samples)
    assert b.input_ids.tolist() == [10, 11, 12, 20, 13, 22, 23]
    assert b.positions.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert b.loss_index.tolist() == [2, 3, 4, 5, 6]  # the position before each target
    assert b.targets.tolist() == [20, 21, 22, 23, 24]
    assert b.seq_idx.tolist() == [0, 0, 1, 1, 1]
    assert b.advantages.tolist() == [0.5, 0.5, -0.5, -0.5, -0.5]
    assert b.old_logprobs.tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]


def test_rank_split_is_balanced_and_micro_batches_respect_the_budget():
    costs = [9, 1, 7, 3, 3, 8, 2, 5]
    plan = assign_to_ranks(costs, 3)
    assert sorted(sum(plan, [])) == list(range(len(costs)))
    loads = [sum(costs[i] for i in p) for p in plan]
    assert max(loads) - min(loads) <= max(costs) and max(loads) <= 14
    assert assign_to_ranks([4], 2) == [[0], []]  # a rank may get nothing (it runs a dummy micro-batch)
    bins = pack_micro_batches(list(range(len(costs))), costs, budget=10)
    assert sorted(sum(bins, [])) == list(range(len(costs)))
    assert all(sum(costs[i] for i in b) <= 10 for b in bins)
    assert pack_micro_batches([0, 1], [30, 2], budget=10) == [[0], [1]]  # too long for the budget: alone


def test_shared_prompt_packing_lays_each_prompt_once_and_aligns_targets():
    samples = [Sample([10, 11, 12, 20], [20, 21], [-1.0, -2.0], 0.5, 0),
               Sample([13, 22, 23], [22, 23, 24], [-3.0, -4.0, -5.0], 1.0, 1),
               Sample([10, 11, 12], [25], [-6.0], -0.5, 0)]    # the first one's prompt; a one-token response
    b = collate(samples, share_prompts=True)
    assert b.input_ids.tolist() == [10, 11, 12, 13, 20, 22, 23]   # prompts once, then each sample's own tokens
    assert b.positions.tolist() == [0, 1, 2, 0, 3, 1, 2]
    assert b.targets.tolist() == [20, 21, 25, 22, 23, 24]
    assert b.loss_index.tolist() == [2, 4, 2, 3, 5, 6]  # a prompt's last token predicts each sample's first target
    assert b.seq_idx.tolist() == [0, 0, 1, 2, 2, 2]
    assert b.old_logprobs.tolist() == [-1.0, -2.0, -6.0, -3.0, -4.0, -5.0]


@pytest.mark.parametrize("budget", [10_000, 9])
def test_shared_prompt_packing_gives_the_unshared_log_probs_gradients_and_step(budget):
    """Same loss, log-probs and update with and without sharing, down to fp32 rounding; with budget 9 every family
    is cut into pieces (each carrying its prompt again) over several micro-batches."""
    groups = make_groups(7, n_groups=4, group_size=5, max_resp=6)
    samples = build_samples(compute_advantages(groups, "std"))
    model = tiny_model()
    lps = []
    for share in (False, True):
        b = collate(samples, share_prompts=share)
        hidden = model(b.input_ids, b.positions, b.attn).index_select(0, b.loss_index)
        lp = (hidden @ model.lm_head.weight.T).log_softmax(-1).gather(-1, b.targets[:, None])[:, 0]
        lps.append(sorted(zip(b.old_logprobs.tolist(), lp.tolist())))   # old log-probs identify the tokens
    assert [o for o, _ in lps[0]] == [o for o, _ in lps[1]]
    assert max(abs(x - y) for (_, x), (_, y) in zip(*lps)) < 1e-5
    out = []
    for share in (False, True):
        tr = Trainer(tiny_model(), TrainConfig(lr=1e-2, micro_batch_tokens=budget, share_prompts=share, **SMOOTH_ADAM))
        m = tr.train_step(groups)
        out.append((weights(tr.model), m))
    (w_a, m_a), (w_b, m_b) = out
    for name in w_a:
        assert torch.allclose(w_a[name], w_b[name], atol=1e-5, rtol=0), name
    assert m_a["loss"] == pytest.approx(m_b["loss"], rel=1e-5)
    assert m_a["grad_norm"] == pytest.approx(m_b["grad_norm"], rel=1e-4)


def test_shared_plan_keeps_groups_together_within_the_budget():
    samples = build_samples(compute_advantages(make_groups(3, n_groups=6, group_size=4, max_resp=8), "none"))
    plans = plan_micro_batches(samples, world=2, budget=40, share_prompts=True)
    assert sorted(i for rank in plans for mb in rank for i in mb) == list(range(len(samples)))
    prompt_of = [tuple(s.tokens[:s.prompt_len]) for s in samples]
    for rank in plans:
        for mb in rank:
            b = collate([samples[i] for i in mb], share_prompts=True)
            assert b.input_ids.numel() <= 40 or len({prompt_of[i] for i in mb}) == 1
    # a family small enough for the budget is never split over ranks or micro-batches
    home = {}
    for r, rank in enumerate(plans):
        for k, mb in enumerate(rank):
            for i in mb:
                home.setdefault(prompt_of[i], set()).add((r, k))
    assert all(len(h) == 1 for h in home.values())
    loads = [sum(collate([samples[i] for i in mb], share_prompts=True).input_ids.numel() for mb in rank)
             for rank in plans]
    assert max(loads) - min(loads) <= 40


def test_lr_schedule_warmup_then_cosine_to_floor():
    f = [lr_factor(s, warmup_steps=2, total_steps=10, schedule="cosine", min_lr_ratio=0.1) for s in range(12)]
    assert f[0] == 0.5 and f[1] == 1.0 and f[2] == 1.0
    assert all(a >= b for a, b in zip(f[2:], f[3:]))
    assert f[10] == pytest.approx(0.1) and f[11] == pytest.approx(0.1)
    assert lr_factor(7, 2, 10, "constant") == 1.0


# ---- the train step ------------------------------------------------------------------------------------------
def test_on_policy_batch_has_ratio_one():
    model = tiny_model(tied=False)
    groups = on_policy_groups(model, seed=0, temperature=0.7)
    tr = Trainer(model, TrainConfig(lr=1e-4, micro_batch_tokens=20), temperature=0.7)
    m = tr.train_step(groups)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["approx_kl"] == pytest.approx(0.0, abs=1e-8)
    assert m["clip_frac_low"] == m["clip_frac_high"] == 0.0
    assert 0 < m["entropy"] <= math.log(VOCAB) + 1e-4


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "seq_sum_norm"])
def test_micro_batch_budget_does_not_change_the_update(agg):
    out = []
    for budget in (1000, 12):
        tr = Trainer(tiny_model(), TrainConfig(lr=1e-2, loss_agg=agg, micro_batch_tokens=budget, **SMOOTH_ADAM),
                     max_response_len=10)
        m = tr.train_step(make_groups(5))
        out.append((weights(tr.model), m))
    (w_a, m_a), (w_b, m_b) = out
    for name in w_a:
        assert torch.allclose(w_a[name], w_b[name], atol=1e-5, rtol=0), name
    assert m_a["loss"] == pytest.approx(m_b["loss"], rel=1e-5)


def test_activation_checkpointing_gives_the_same_step():
    out = []
    for ac in (False, True):
        tr = Trainer(tiny_model(tied=False), TrainConfig(lr=1e-2, activation_checkpointing=ac, micro_batch_tokens=30,
                                                        minibatches=2, ppo_epochs=2, **SMOOTH_ADAM))
        ms = [tr.train_step(make_groups(s)) for s in (1, 2)]
        out.append((weights(tr.model), ms))
    (w_off, m_off), (w_on, m_on) = out
    for name in w_off:
        assert torch.allclose(w_off[name], w_on[name], atol=1e-5, rtol=0), name
    assert m_on[-1]["optimizer_steps"] == 4 and m_on[-1]["grad_norm"] == pytest.approx(m_off[-1]["grad_norm"])


def test_all_groups_filtered_skips_the_step():
    groups = make_groups(4)
    for g in groups:
        for t in g.trajectories:
            t.reward = 1.0
    tr = Trainer(tiny_model(), TrainConfig(lr=1e-2, filter_zero_variance=True))
    before = weights(tr.model)
    m = tr.train_step(groups)
    assert m["skipped"] == 1.0 and m["filtered_groups"] == 3.0 and m["optimizer_steps"] == 0.0
    assert all(torch.equal(before[n], p) for n, p in weights(tr.model).items())


def test_config_errors():
    with pytest.raises(ValueError, match="max_response_len"):
        Trainer(tiny_model(), TrainConfig(loss_agg="seq_sum_norm"))
    with pytest.raises(ValueError, match="reference model"):
        Trainer(tiny_model(), TrainConfig(kl_coef=0.1))


def test_learning_smoke_reward_for_even_tokens():
    """Reward = share of even tokens in the response: a few steps raise the policy's probability of even tokens."""
    torch.manual_seed(0)
    model = tiny_model(tied=False)
    eval_prompts = torch.randint(3, VOCAB, (16, 5), generator=torch.Generator().manual_seed(99))
    even = torch.arange(VOCAB) % 2 == 0

    def p_even() -> float:
        with torch.no_grad():
            cu = cu_seqlens_from_lengths([5] * len(eval_prompts))
            probs = model.forward_packed(eval_prompts.reshape(-1), cu)[cu[1:] - 1].softmax(-1)
        return float(probs[:, even].sum(-1).mean())

    tr = Trainer(model, TrainConfig(lr=3e-3, clip_high=0.28, loss_agg="token_mean", micro_batch_tokens=64))
    start = p_even()
    rewards = []
    for step in range(6):
        groups = on_policy_groups(model, seed=step, reward=lambda r: sum(t % 2 == 0 for t in r) / len(r))
        m = tr.train_step(groups)
        rewards.append(m["reward_mean"])
    assert p_even() > start + 0.05, (start, p_even(), rewards)  # 0.50 -> 0.60 when written


def test_checkpoints_keep_last_and_latest(tmp_path):
    from trainer.checkpoint import completed, latest
    tr = Trainer(tiny_model(), TrainConfig(lr=1e-2))
    assert latest(tmp_path) is None
    for s in range(3):
        tr.train_step(make_groups(s))
        tr.save_checkpoint(tmp_path, extra={"s": s}, keep_last=2)
    assert [step for step, _ in completed(tmp_path)] == [2, 3]
    assert latest(tmp_path).name == "step_3"
    fresh = Trainer(tiny_model(seed=5), TrainConfig(lr=1e-2))
    assert fresh.load_checkpoint(latest(tmp_path)) == {"s": 2} and fresh.step == 3
    for name, p in weights(fresh.model).items():
        assert torch.equal(p, weights(tr.model)[name]), name


def test_non_finite_gradients_skip_the_step_and_stop_after_a_streak():
    from trainer.trainer import NonFiniteError
    tr = Trainer(tiny_model(), TrainConfig(lr=1e-2, max_nonfinite_steps=2))
    bad = make_groups(5)
    bad[0].trajectories[0].logprobs[0] = float("nan")  # a NaN behaviour log-prob poisons the ratio and the loss
    before = weights(tr.model)
    m = tr.train_step(bad)
    assert m["nonfinite_skipped"] == 1.0 and tr.nonfinite_steps == 1
    assert all(torch.equal(before[n], p) for n, p in weights(tr.model).items())  # weights untouched
    assert tr.optimizer_steps == 0 and not tr.optimizer.state                       # optimizer state untouched
    m = tr.train_step(make_groups(6))                                               # a good step resets the streak
    assert m["nonfinite_skipped"] == 0.0 and tr.optimizer_steps == 1
    tr.train_step(bad)
    with pytest.raises(NonFiniteError, match="2 optimizer steps in a row"):
        tr.train_step(bad)


def test_micro_batch_tensors_through_arrays_hold_what_torch_tensor_would():
    """trainer/batch.py `_tensor` (an array instead of a list for torch): the same dtype and values, fp32 rounding
    included, and empty lists give empty tensors."""
    from trainer.batch import _tensor
    xs = [0.1, -3.0000001, 1e-40, 2.5e38, float("nan")]
    got, want = _tensor(xs, "f", "cpu"), torch.tensor(xs, dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got[:4], want[:4]) and got[4].isnan()
    ids = [0, 2**40, -1]
    assert torch.equal(_tensor(ids, "q", "cpu"), torch.tensor(ids, dtype=torch.long))
    assert _tensor([], "q", "cpu").shape == (0,) and _tensor([], "f", "cpu").dtype == torch.float32

"""GRPO policy loss over packed tokens, with the variants users expect. Pure functions on tensors.

Per token t of sequence i (only tokens with mask = 1 count):
    ratio r_t      = exp(logp_t - old_logp_t)                                   ratio_level="token" (PPO / GRPO)
                   = sg[s_i] * exp(logp_t - sg[logp_t]),
                     s_i = exp(mean_{t in i}(logp_t - old_logp_t))              ratio_level="sequence" (GSPO,
                     Zheng et al. 2025, in the paper's GSPO-token form: the value is the sequence ratio, the
                     gradient is s_i * grad logp_t, so clipping acts per sequence; with equal advantages over a
                     sequence this is exactly GSPO's sequence-level gradient)
    pg_t           = max(-A_i r_t, -A_i clip(r_t, 1 - clip_low, 1 + clip_high))  (PPO clip; separate bounds are
                     DAPO's clip-higher, Yu et al. 2025, section 3.1)
                   = -A_i r_t                                                   clip=False (M2PO's objective, arXiv
                     2510.01161 Eq. 5, where the second-moment mask stands in for the clip)
    kl_t           = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                 (k3 estimator of KL(pi || ref),
                     as in GRPO; weighted by kl_coef)
    l_t            = pg_t + kl_coef * kl_t
Decoupled PPO (AReaL, Fu et al. 2025), when `prox_logp` is given (train.off_policy = "decoupled"): the behaviour
policy (old_logp: whatever engine versions produced each token) and the proximal policy (prox_logp: the trainer's
weights at the start of the train call) are separate. Clipping is against the proximal policy and the off-policy
gap is corrected by a per-token truncated importance weight:
    r_t            = exp(logp_t - prox_t)            (in place of old_logp_t above, at either ratio level)
    w_t            = sg[min(exp(prox_t - old_logp_t), is_cap)]      (is_cap = 0: no truncation)
    pg_t           = w_t * max(-A_i r_t, -A_i clip(r_t, 1 - clip_low, 1 + clip_high))
The KL penalty is not weighted. Two treatments of a token whose weight exceeds the cap (`is_mode`): "clamp" (the
default: truncated IS, as in TIS and verl's rollout correction; no token is silently removed) or "mask" (AReaL's:
the token's weight is 0, so it adds nothing to the gradient; it still counts in the normaliser, which is fixed per
optimizer step; AReaL's `rejection_sampling` with action "mask", areal/api/cli_args.py).
Off-policy corrections (`correction`, rl/correction.py; train.correction): a detached per-token weight w_t from
the trainer-vs-behaviour log ratio l_t = trainer_t - old_logp_t, where trainer_t is prox_t on the decoupled path and
otherwise `trainer_logp` (default: the detached logp_t, the current weights):
    pg_t           = w_t * max(-A_i r_t, -A_i clip(r_t, 1 - clip_low, 1 + clip_high))
in place of the decoupled weight above (is_cap / is_mode apply only with correction "none"). A weighting correction
(tis, token_mask, seq_tis, seq_mask: w_t is itself an importance ratio) takes the ratio r_t against trainer_t on
either path, as TIS and TRL do (otherwise exp(l_t) would be counted in r_t and again in w_t); the rejection-only
ones (geo_mask, opsm, m2po: w_t in {0, 1}) keep the path's ratio. Mismatch statistics (rl/mismatch.py) are summed
for every call: KL(behaviour || trainer) by k3, the ratio exp(l_t)'s mean and max, by staleness bucket.
Aggregation (`normaliser` is for the whole optimizer step, so micro-batching never changes loss or gradients):
    token_mean     sum_t l_t / N_tokens                         DAPO token-level loss (section 3.3)
    seq_mean       sum_i (sum_{t in i} l_t / |i|) / N_seqs       GRPO's original sample-level mean
    seq_sum_norm   sum_i (sum_{t in i} l_t / max_len) / N_seqs   Dr.GRPO (Liu et al. 2025): a constant length
Sequences are never split across micro-batches, so per-sequence sums are complete within one call.
Multi-turn episodes: `mask` is 0 on an episode's observation tokens (Trajectory.loss_mask), so "tokens" above are
the model's tokens only: N_tokens counts them, |i| is sequence i's model tokens, sequence ratios (GSPO) and every
statistic are over them. An observation token adds nothing to the loss or its gradient whatever its behaviour
log-prob says (it is replaced by the current one there, so even a NaN cannot leak through a zero weight).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rl.correction import Correction, correct
from rl.mismatch import mismatch_sums

LOSS_AGGS = ("token_mean", "seq_mean", "seq_sum_norm")
RATIO_LEVELS = ("token", "sequence")


@dataclass
class LossOutput:
    loss: torch.Tensor                         # scalar, already divided by the (global) normaliser
    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # detached sums over masked tokens
    token_count: torch.Tensor | int = 0        # masked tokens in this call (a tensor: read on demand, no sync)
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)  # detached maxima over masked tokens

    @property
    def num_tokens(self) -> int:
        return int(self.token_count)

    def metrics(self) -> dict[str, float]:
        """Token means of the statistics of this call alone."""
        n = max(self.num_tokens, 1)
        return {k: float(v) / n for k, v in self.sums.items()}


def segment_sum(x: torch.Tensor, seq_idx: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[N] values, [N] sequence index in [0, num_seqs) -> [num_seqs] sums (differentiable)."""
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq_idx, x)


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator with log_ratio = log q(x) - log p(x), x ~ p: an unbiased, non-negative KL(p || q)."""
    return torch.exp(log_ratio) - log_ratio - 1


IS_MODES = ("clamp", "mask")


def importance_weight(prox_logp: torch.Tensor, old_logp: torch.Tensor, is_cap: float, mode: str = "clamp"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO's per-token weight pi_prox / pi_behaviour, detached; above is_cap (0: no cap) clamped to it
    (mode "clamp") or 0 (mode "mask", AReaL's). Returns (weight, truncated) where truncated marks the tokens whose
    raw weight exceeded the cap."""
    if mode not in IS_MODES:
        raise ValueError(f"is_mode {mode!r} is not one of {IS_MODES}")
    raw = torch.exp(prox_logp.detach() - old_logp.detach())
    if not is_cap:
        return raw, torch.zeros_like(raw, dtype=torch.bool)
    over = raw > is_cap
    return (raw.clamp(max=is_cap) if mode == "clamp" else raw.masked_fill(over, 0.0)), over


def default_normaliser(loss_agg: str, mask: torch.Tensor, seq_idx: torch.Tensor, num_seqs: int) -> float:
    """The normaliser of this batch alone: masked tokens (token_mean) or sequences with any masked token."""
    if loss_agg == "token_mean":
        return float(mask.sum())
    return float((segment_sum(mask.float(), seq_idx, num_seqs) > 0).sum())


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, seq_idx: torch.Tensor,
                mask: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None, *,
                clip_low: float = 0.2, clip_high: float = 0.2, loss_agg: str = "token_mean",
                ratio_level: str = "token", kl_coef: float = 0.0, max_len: int | None = None,
                normaliser: float | None = None, num_seqs: int | None = None,
                prox_logp: torch.Tensor | None = None, is_cap: float = 0.0, is_mode: str = "clamp",
                trainer_logp: torch.Tensor | None = None, correction: Correction | None = None,
                staleness: torch.Tensor | None = None, clip: bool = True,
                correction_keep: torch.Tensor | None = None) -> LossOutput:
    """The GRPO loss of one (micro-)batch of packed tokens; see the module docstring for the formulas.

    logp: [N] current policy log-probs (with grad); old_logp: [N] behaviour log-probs; advantages: [N] (the
    sequence's advantage on each of its tokens); seq_idx: [N] int64 in [0, num_seqs); mask: [N] 1 where the token
    is trained on (0: an observation token of a multi-turn episode, or a dummy batch); ref_logp: [N] or None.
    normaliser: tokens (token_mean) or sequences (seq_*) of the whole step; None means this batch alone. prox_logp: [N] proximal log-probs (no grad) for decoupled PPO, None for plain PPO
    against the behaviour policy; is_cap: truncation of the decoupled importance weight (0: none); is_mode: what
    happens above it (IS_MODES). trainer_logp: [N] the trainer-side log-probs of the correction and the mismatch
    statistics when prox_logp is None (default: logp, detached); correction: rl/correction.py (None: none);
    staleness: [N] trainer version minus each token's version, for the per-bucket mismatch statistics. clip: False
    drops the PPO clip (pg = -A r; the clip_frac statistics still count the tokens outside the range).
    correction_keep: [N] bool, M2PO's kept tokens ranked over the whole batch (rl/correction.py `correct`).
    """
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg {loss_agg!r} is not one of {LOSS_AGGS}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level {ratio_level!r} is not one of {RATIO_LEVELS}")
    if loss_agg == "seq_sum_norm" and not max_len:
        raise ValueError("loss_agg='seq_sum_norm' (Dr.GRPO) needs max_len, the constant per-sequence divisor")
    if kl_coef and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logp")
    if is_cap < 0:
        raise ValueError(f"is_cap must be >= 0 (0: no truncation), got {is_cap}")
    seq_idx = seq_idx.long()
    num_seqs = int(seq_idx.max()) + 1 if num_seqs is None and seq_idx.numel() else int(num_seqs or 0)
    mask = (torch.ones_like(logp) if mask is None else mask).to(logp.dtype)
    old_logp, advantages = old_logp.to(logp.dtype), advantages.to(logp.dtype)
    # untrained positions read the current log-prob as their behaviour one: every term there is finite and neutral
    # (ratio 1), so their zero weight zeroes them even when the recorded value is garbage (inf * 0 would be NaN)
    old_logp = torch.where(mask > 0, old_logp, logp.detach())
    if normaliser is None:
        normaliser = default_normaliser(loss_agg, mask, seq_idx, num_seqs)
    normaliser = float(normaliser) if float(normaliser) > 0 else 1.0  # an empty batch has a zero numerator

    corr = correction or Correction()
    trainer_side = logp if trainer_logp is None else trainer_logp
    trainer_lp = (trainer_side if prox_logp is None else prox_logp).detach().to(logp.dtype)
    anchor = old_logp if prox_logp is None else prox_logp.detach().to(logp.dtype)  # the ratio's denominator
    if prox_logp is None and corr.weighting:
        anchor = trainer_lp
    log_ratio = logp - anchor
    if ratio_level == "token":
        ratio = torch.exp(log_ratio)
    else:
        seq_tokens = segment_sum(mask, seq_idx, num_seqs).clamp(min=1)
        seq_log_ratio = segment_sum(log_ratio.detach() * mask, seq_idx, num_seqs) / seq_tokens
        ratio = torch.exp(logp - logp.detach() + seq_log_ratio[seq_idx])
    pg = -advantages * ratio
    if clip:
        pg = torch.maximum(pg, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high))
    is_weight = truncated = cout = None
    if corr.active:
        cout = correct(corr, trainer_lp - old_logp, advantages, seq_idx, mask, num_seqs, correction_keep)
        pg = pg * cout.weight
    elif prox_logp is not None:
        is_weight, truncated = importance_weight(anchor, old_logp, is_cap, is_mode)
        pg = pg * is_weight
    per_token = pg
    kl_ref = None
    if ref_logp is not None:
        kl_ref = k3(ref_logp.to(logp.dtype) - logp)
        if kl_coef:
            per_token = per_token + kl_coef * kl_ref
    per_token = per_token * mask

    if loss_agg == "token_mean":
        loss = per_token.sum() / normaliser
    else:
        seq_sum = segment_sum(per_token, seq_idx, num_seqs)
        if loss_agg == "seq_mean":
            seq_sum = seq_sum / segment_sum(mask, seq_idx, num_seqs).clamp(min=1)
        else:
            seq_sum = seq_sum / float(max_len)
        loss = seq_sum.sum() / normaliser

    with torch.no_grad():
        r = ratio.detach()
        sums = {
            "clip_frac_low": ((advantages < 0) & (r < 1 - clip_low)).to(mask.dtype).mul(mask).sum(),
            "clip_frac_high": ((advantages > 0) & (r > 1 + clip_high)).to(mask.dtype).mul(mask).sum(),
            "approx_kl": (k3(logp.detach() - anchor) * mask).sum(),  # KL(anchor || new), x ~ anchor
            "ratio_mean": (r * mask).sum(),
            "pg_loss": (pg.detach() * mask).sum(),
        }
        if kl_ref is not None:
            sums["kl_ref"] = (kl_ref.detach() * mask).sum()
        if is_weight is not None and truncated is not None:
            sums["is_weight_mean"] = (is_weight * mask).sum()
            sums["is_truncated_frac"] = (truncated.to(mask.dtype) * mask).sum()
        if cout is not None:
            sums["correction_weight_mean"] = (cout.weight * mask).sum()
            sums["correction_clipped_frac"] = (cout.clipped.to(mask.dtype) * mask).sum()
            sums["correction_masked_frac"] = (cout.masked.to(mask.dtype) * mask).sum()
        mismatch, ratio_max = mismatch_sums(trainer_lp - old_logp, mask, staleness)
        sums.update(mismatch)
    # token count and maxima stay device scalars: reading them here would wait for the forward
    return LossOutput(loss, sums, mask.sum(), {"mismatch_ratio_max": ratio_max})

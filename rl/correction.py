"""Off-policy corrections of the behaviour-vs-trainer gap (`train.correction`). Pure functions on packed tokens.

Every correction reads one quantity per trained token t of sequence i, the log importance ratio between the
trainer's policy and the behaviour policy that sampled the token:
    l_t = log pi_trainer(y_t) - log pi_behaviour(y_t),   r_t = exp(l_t)
pi_behaviour is what the engine sampled with (`Trajectory.logprobs`); pi_trainer is the trainer's log-prob under
the weights it holds at the start of the train call (the proximal policy of decoupled PPO; with one optimizer step
per call, the detached current log-probs). With S_i = sum_{t in i} l_t and n_i the sequence's trained tokens, each
correction gives a detached weight w_t that multiplies the token's policy-gradient term (0 = the token is masked):
    tis         w_t = clamp(r_t, lo, hi)                                   token-level truncated IS: Yao et al., "Your
                Efficient RL Framework Secretly Brings You Off-Policy RL Training" (fengyao.notion.site/off-policy-rl);
                TRL `vllm_importance_sampling_mode="token_truncate"` (trl/trainer/grpo_trainer.py); verl
                `rollout_is="token"` (verl/trainer/ppo/rollout_corr_helper.py)
    token_mask  w_t = r_t if lo <= r_t <= hi else 0                        masked IS (MIS) and IcePop's M(k) = k on
                [alpha, beta], else 0 (Ling team, Ring-1T, arXiv 2510.18855, IcePop objective); TRL "token_mask"
    seq_tis     w_t = clamp(exp(S_i), lo, hi)                              sequence-level truncated IS (product of
                the token ratios): TRL "sequence_truncate"; verl `rollout_is="sequence"`
    seq_mask    w_t = exp(S_i) if lo <= exp(S_i) <= hi else 0              sequence-level masked IS: TRL
                "sequence_mask"
    geo_mask    w_t = 1 if lo <= exp(S_i / n_i) <= hi else 0               geometric-mean rejection: verl
                `rollout_rs="geometric"` (Liu, Li et al., "When Speed Kills Stability", richardli.xyz/rl-collapse)
    opsm        w_t = 0 if A_i < 0 and -S_i / n_i > delta else 1           off-policy sequence masking: DeepSeek-V3.2,
                arXiv 2512.02556, eq. 9 (the mean of log pi_behaviour - log pi_theta over the sequence is its KL
                estimate); TRL `off_policy_mask_threshold` (GRPOTrainer.get_off_policy_mask)
    m2po        w_t = 0 for the candidate tokens of largest l_t^2, the fewest such that the mean of l_t^2 over the
                remaining candidates is <= tau; else 1. M2PO, Zheng et al., "Prosperity before Collapse", arXiv
                2510.01161, Algorithm 1 (`m2po_tokens = "trust_region"`, the default): the candidates are the
                trust-region tokens, where PPO's clip could act (A_i > 0 and r_t > 1, or A_i < 0 and r_t < 1),
                masked one by one from the largest while their mean exceeds tau_M2 (all of them if need be);
                `m2po_tokens = "all"`: every trained token, all but the smallest masked if no set gets there
                (AReaL's `apply_m2po_masking`). `m2po_scope = "batch"` (the default; the paper's text and AReaL):
                ranked over every trained token of the optimizer step's batch, on every train rank, whose trainer
                log-probs a no-grad pass takes before the first backward (the trainer passes the result in as
                `keep`); "micro_batch": over one loss call's tokens, as the authors' code does
                (github.com/Infini-AI-Lab/M2PO, dp_actor's micro-batch loop). The paper's objective (Eq. 5) is the
                unclipped ratio against the behaviour policy: `train.ppo_clip = false`, `train.off_policy =
                "behaviour"` (rl/loss.py)
Trained tokens are the model's: a multi-turn episode's observation tokens (mask 0) are in no sum, no count n_i
and no M2PO ranking, so S_i is the product of the ratios of the model's own tokens.
lo = 0 means no lower bound. A masked token adds nothing to the loss or the gradient but still counts in the
normaliser, which is fixed per optimizer step (verl's and AReaL's rejection drop it from their per-batch
denominators instead). The weights carry no gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CORRECTIONS = ("none", "tis", "token_mask", "seq_tis", "seq_mask", "geo_mask", "opsm", "m2po")
M2PO_TOKENS = ("trust_region", "all")
M2PO_SCOPES = ("batch", "micro_batch")
# corrections whose weight is an importance ratio: the PPO ratio is then taken against the trainer's log-probs, so
# that r_t is not counted twice (Yao et al.; TRL's ratio is against `old_per_token_logps`, its IS weight against
# the sampling log-probs)
WEIGHTING = ("tis", "token_mask", "seq_tis", "seq_mask")


@dataclass(frozen=True)
class Correction:
    """One correction and its thresholds (`train.correction*`, `train.opsm_delta`, `train.m2po_tau`)."""
    kind: str = "none"
    low: float = 0.0       # lower bound on the ratio (0: none)
    high: float = 2.0      # upper bound on the ratio
    opsm_delta: float = 0.5
    m2po_tau: float = 0.04
    m2po_tokens: str = "trust_region"   # M2PO's candidates: its Algorithm 1's trust-region tokens, or "all" (AReaL)
    m2po_scope: str = "batch"           # M2PO's ranking over the optimizer step's batch, or one micro-batch

    def __post_init__(self) -> None:
        if self.kind not in CORRECTIONS:
            raise ValueError(f"correction {self.kind!r} is not one of {CORRECTIONS}")
        if self.m2po_tokens not in M2PO_TOKENS:
            raise ValueError(f"m2po_tokens {self.m2po_tokens!r} is not one of {M2PO_TOKENS}")
        if self.m2po_scope not in M2PO_SCOPES:
            raise ValueError(f"m2po_scope {self.m2po_scope!r} is not one of {M2PO_SCOPES}")
        if not 0 <= self.low < self.high:
            raise ValueError(f"correction bounds need 0 <= low < high, got low={self.low}, high={self.high}")

    @property
    def active(self) -> bool:
        return self.kind != "none"

    @property
    def weighting(self) -> bool:
        return self.kind in WEIGHTING

    @property
    def batch_m2po(self) -> bool:
        """M2PO ranked over the whole batch: the trainer computes `keep` (m2po_keep over every rank's tokens)."""
        return self.kind == "m2po" and self.m2po_scope == "batch"


@dataclass
class CorrectionOut:
    weight: torch.Tensor   # [N] detached weight of each token's policy-gradient term (0: masked)
    clipped: torch.Tensor  # [N] bool: the weight was truncated to a bound
    masked: torch.Tensor   # [N] bool: the token was masked (weight 0)


def _seg_sum(x: torch.Tensor, seq_idx: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add(0, seq_idx, x)


def m2po_keep(log_ratio: torch.Tensor, mask: torch.Tensor, tau: float, advantages: torch.Tensor | None = None,
              tokens: str = "trust_region") -> torch.Tensor:
    """[N] bool, the tokens M2PO keeps (see the module docstring), computed on the device with no host read. The
    candidates: trained tokens (`mask`) in the trust region (A > 0 and l > 0, or A < 0 and l < 0; needs
    `advantages`), or every trained token with `tokens = "all"`; the others are kept and count in no mean."""
    valid = mask > 0
    if tokens == "trust_region":
        if advantages is None:
            raise ValueError("m2po over the trust-region tokens needs the advantages")
        valid = valid & (((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0)))
    elif tokens != "all":
        raise ValueError(f"m2po tokens {tokens!r} is not one of {M2PO_TOKENS}")
    m2 = torch.where(valid, log_ratio * log_ratio, torch.zeros_like(log_ratio))
    order = torch.argsort(torch.where(valid, m2, torch.full_like(m2, -1.0)), descending=True, stable=True)
    v, m = valid[order].to(m2.dtype), m2[order]
    suffix_sum = m.flip(0).cumsum(0).flip(0)
    suffix_cnt = v.flip(0).cumsum(0).flip(0)
    below = (suffix_sum / suffix_cnt.clamp(min=1) <= tau) & (v > 0)
    n_valid = v.sum().long()
    # none gets there: Algorithm 1 masks every candidate (its loop ends with T empty), AReaL all but the smallest
    none = n_valid if tokens == "trust_region" else n_valid - 1
    first = torch.where(below.any(), below.to(torch.int64).argmax(), none)   # candidates masked, largest first
    masked_sorted = (torch.arange(m2.numel(), device=m2.device) < first) & (v > 0)
    return ~torch.zeros_like(valid).scatter(0, order, masked_sorted) & (mask > 0)


def correct(c: Correction, log_ratio: torch.Tensor, advantages: torch.Tensor, seq_idx: torch.Tensor,
            mask: torch.Tensor, num_seqs: int, keep: torch.Tensor | None = None) -> CorrectionOut:
    """The correction's per-token weight from l_t = `log_ratio` (trainer minus behaviour, [N]); `advantages` [N]
    (the sequence's advantage on each token), `seq_idx` [N] in [0, num_seqs), `mask` [N] (1: trained). `keep` [N]
    bool: M2PO's kept tokens computed over a larger batch (m2po_scope = "batch"); None ranks these tokens alone."""
    lr = log_ratio.detach()
    none = torch.zeros_like(lr, dtype=torch.bool)
    if c.kind == "none":
        return CorrectionOut(torch.ones_like(lr), none, none)
    if c.kind == "m2po":
        kept = m2po_keep(lr, mask, c.m2po_tau, advantages, c.m2po_tokens) if keep is None else keep
        drop = ~kept & (mask > 0)
        return CorrectionOut((~drop).to(lr.dtype), none, drop)
    if c.kind in ("tis", "token_mask"):
        r = torch.exp(lr)
    else:
        seq_sum = _seg_sum(lr * mask, seq_idx, num_seqs)
        if c.kind in ("seq_tis", "seq_mask"):
            r = torch.exp(seq_sum)[seq_idx]   # may overflow to inf: then it is clipped or masked
        else:
            seq_mean = (seq_sum / _seg_sum(mask, seq_idx, num_seqs).clamp(min=1))[seq_idx]
            if c.kind == "opsm":
                drop = (advantages < 0) & (-seq_mean > c.opsm_delta)
                return CorrectionOut((~drop).to(lr.dtype), none, drop)
            r = torch.exp(seq_mean)          # geo_mask
    out = (r < c.low) | (r > c.high)
    if c.kind in ("tis", "seq_tis"):
        return CorrectionOut(r.clamp(min=c.low, max=c.high), out, none)
    if c.kind == "geo_mask":
        return CorrectionOut((~out).to(lr.dtype), none, out)
    return CorrectionOut(r.masked_fill(out, 0.0), none, out)

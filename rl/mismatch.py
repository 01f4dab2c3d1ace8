"""The behaviour-vs-trainer mismatch of the trained tokens, as device sums for the per-step metrics (metrics.jsonl).

With l_t = log pi_trainer(y_t) - log pi_behaviour(y_t) (rl/correction.py) and y_t sampled from pi_behaviour:
    mismatch_kl_k3       mean_t (exp(l_t) - 1 - l_t)    Schulman's k3 estimator of KL(pi_behaviour || pi_trainer)
                         (k3 with q = pi_trainer, p = pi_behaviour: (q/p) - 1 - log(q/p)); verl's `k3_kl`
                         (verl/trainer/ppo/rollout_corr_helper.py, compute_offpolicy_metrics)
    mismatch_ratio_mean  mean_t r_t,  mismatch_ratio_max  max_t r_t
    mismatch_kl_k3_<bucket>   the k3 mean over the tokens whose staleness (the trainer's version minus the token's
                         `Trajectory.versions` entry) falls in the bucket: stale0 (0), stale1 (1), stale2_3 (2-3),
                         stale4plus (>= 4); a bucket without tokens in the step is not reported
Only trained tokens count (mask 1: a multi-turn episode's observation tokens, sampled by no policy, are left out).
Everything is a sum (or, for the max, a max) over masked tokens on the device, so the trainer reads it with the
other loss statistics: no host read per micro-batch.
"""
from __future__ import annotations

import torch

# (metric suffix, lowest staleness, highest staleness or None for no upper end)
STALENESS_BUCKETS = (("stale0", 0, 0), ("stale1", 1, 1), ("stale2_3", 2, 3), ("stale4plus", 4, None))
BUCKET_KEYS = tuple(f"mismatch_kl_k3_{name}" for name, _, _ in STALENESS_BUCKETS)
COUNT_KEYS = tuple(f"tokens_{name}" for name, _, _ in STALENESS_BUCKETS)


def k3_behaviour_trainer(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(behaviour || trainer) from l = log trainer - log behaviour, tokens ~ behaviour."""
    return torch.exp(log_ratio) - 1 - log_ratio


@torch.no_grad()
def mismatch_sums(log_ratio: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor | None = None
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(sums over masked tokens, max ratio) of one micro-batch. sums: mismatch_kl_k3, mismatch_ratio_mean and,
    with `staleness` [N] (trainer version minus token version), each bucket's k3 sum and its token count."""
    lr = log_ratio.detach().to(mask.dtype)
    r = torch.exp(lr)
    kl = k3_behaviour_trainer(lr) * mask
    sums = {"mismatch_kl_k3": kl.sum(), "mismatch_ratio_mean": (r * mask).sum()}
    if staleness is not None:
        for (name, lo, hi), key, count in zip(STALENESS_BUCKETS, BUCKET_KEYS, COUNT_KEYS):
            inside = (staleness >= lo) if hi is None else (staleness >= lo) & (staleness <= hi)
            sel = inside.to(mask.dtype) * mask
            sums[key] = (kl * sel).sum()
            sums[count] = sel.sum()
    r_max = torch.where(mask > 0, r, torch.zeros_like(r)).max() if r.numel() else r.new_zeros(())
    return sums, r_max

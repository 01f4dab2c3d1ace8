"""Group-relative advantages (GRPO) and dynamic filtering of zero-variance groups.

- `adv_norm="std"`: A_i = (r_i - mean(r)) / (std(r) + eps) within each group, as in GRPO (DeepSeekMath, Shao et al.
  2024). std is the sample (Bessel-corrected) standard deviation, as torch.std / TRL / verl compute it.
- `adv_norm="none"`: A_i = r_i - mean(r), Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"), which
  drops the std division because it up-weights groups that are almost all right or almost all wrong.
- Dynamic sampling filter (DAPO, Yu et al. 2025, section 3.2): a group whose rewards are all equal has all-zero
  advantages and contributes no policy gradient, only noise in the normaliser; it is dropped and counted.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rl.types import Group

ADV_NORMS = ("std", "none")


def group_advantages(rewards: Sequence[float], adv_norm: str = "std", eps: float = 1e-6) -> list[float]:
    """Advantages of one group's rewards. A group of one (or of equal rewards) gets all zeros."""
    if adv_norm not in ADV_NORMS:
        raise ValueError(f"adv_norm {adv_norm!r} is not one of {ADV_NORMS}")
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if adv_norm == "none":
        return centred
    std = math.sqrt(sum(c * c for c in centred) / (n - 1)) if n > 1 else 0.0
    return [c / (std + eps) for c in centred]


def is_zero_variance(rewards: Sequence[float], tol: float = 1e-8) -> bool:
    return len(rewards) == 0 or max(rewards) - min(rewards) <= tol


@dataclass
class Advantages:
    groups: list[Group]             # the groups kept, in input order
    advantages: list[list[float]]   # advantages[i][j]: trajectory j of groups[i]
    num_filtered: int               # zero-variance groups dropped
    num_groups: int                 # groups given


def compute_advantages(groups: Sequence[Group], adv_norm: str = "std", filter_zero_variance: bool = True,
                       eps: float = 1e-6) -> Advantages:
    """Advantages for every trajectory of every group, dropping zero-variance groups when asked."""
    kept, advs, filtered = [], [], 0
    for g in groups:
        rewards = g.rewards
        if filter_zero_variance and is_zero_variance(rewards):
            filtered += 1
            continue
        kept.append(g)
        advs.append(group_advantages(rewards, adv_norm, eps))
    return Advantages(kept, advs, filtered, len(groups))

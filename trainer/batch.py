"""From GRPO groups to packed per-token tensors: samples, the split over train ranks, micro-batches by a token budget.

A trajectory becomes one packed sequence `prompt + response[:-1]`; the hidden state at position p predicts token
p + 1, so the last len(response) positions are the ones trained on (targets = the response, old log-probs = the
behaviour policy's, from `Trajectory.logprobs`). Every train rank computes the same plan from the same groups:
sequences go to ranks longest first onto the least loaded (balanced by tokens), then into micro-batches first-fit
decreasing under `micro_batch_tokens`. Ranks with fewer micro-batches than the busiest run zero-weight dummy ones,
because FSDP's collectives need every rank in every forward and backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from model.attention import cu_seqlens_from_lengths, positions_from_cu_seqlens
from rl.advantages import Advantages


@dataclass
class Sample:
    tokens: list[int]           # model input: prompt + response[:-1]
    targets: list[int]          # the response: targets of the last len(targets) input positions
    old_logprobs: list[float]   # behaviour log-probs of the targets
    advantage: float
    group_id: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def build_samples(adv: Advantages) -> list[Sample]:
    """One Sample per trajectory with a non-empty response, in group order."""
    out = []
    for group, advantages in zip(adv.groups, adv.advantages):
        for t, a in zip(group.trajectories, advantages):
            if not t.response_ids:
                continue
            if not t.prompt_ids:
                raise ValueError(f"group {group.group_id} sample {t.sample_index}: empty prompt (the first "
                                 "response token would have no context to be predicted from)")
            if len(t.logprobs) != len(t.response_ids):
                raise ValueError(f"group {group.group_id} sample {t.sample_index}: {len(t.logprobs)} behaviour "
                                 f"logprobs for {len(t.response_ids)} response tokens")
            out.append(Sample(list(t.prompt_ids) + list(t.response_ids[:-1]), list(t.response_ids),
                              list(t.logprobs), float(a), group.group_id))
    return out


def split_even(n: int, parts: int) -> list[range]:
    """[0, n) cut into `parts` contiguous ranges whose sizes differ by at most one (some empty if n < parts)."""
    q, r = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + q + (i < r))
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def assign_to_ranks(costs: list[int], world: int) -> list[list[int]]:
    """Indices of `costs` per rank: longest first onto the least loaded rank (ties: lowest rank); sorted per rank."""
    load = [0] * world
    plan: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        plan[r].append(i)
        load[r] += costs[i]
    return [sorted(p) for p in plan]


def pack_micro_batches(indices: list[int], costs: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing into bins of at most `budget` tokens (a longer sequence gets a bin of its own)."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(indices, key=lambda i: (-costs[i], i)):
        for b in range(len(bins)):
            if used[b] + costs[i] <= budget:
                bins[b].append(i)
                used[b] += costs[i]
                break
        else:
            bins.append([i])
            used.append(costs[i])
    return [sorted(b) for b in bins]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor     # [T] packed inputs
    positions: torch.Tensor     # [T]
    cu_seqlens: torch.Tensor    # [S + 1] int32
    loss_index: torch.Tensor    # [N] positions in [0, T) whose next token is trained on
    targets: torch.Tensor       # [N]
    old_logprobs: torch.Tensor  # [N] fp32
    advantages: torch.Tensor    # [N] fp32
    seq_idx: torch.Tensor       # [N] int64 in [0, S)
    mask: torch.Tensor          # [N] fp32: 1 for real tokens, 0 in a dummy batch
    num_seqs: int

    @property
    def num_loss_tokens(self) -> int:
        return int(self.mask.sum().item())


def collate(samples: list[Sample], device: torch.device | str = "cpu") -> MicroBatch:
    lengths = [s.num_tokens for s in samples]
    cu = cu_seqlens_from_lengths(lengths)
    loss_index, seq_idx = [], []
    for i, (s, start) in enumerate(zip(samples, cu[:-1].tolist())):
        first = start + s.num_tokens - len(s.targets)
        loss_index.extend(range(first, start + s.num_tokens))
        seq_idx.extend([i] * len(s.targets))
    n = len(loss_index)
    f32 = dict(dtype=torch.float32, device=device)
    return MicroBatch(
        input_ids=torch.tensor([t for s in samples for t in s.tokens], dtype=torch.long, device=device),
        positions=positions_from_cu_seqlens(cu).to(device),
        cu_seqlens=cu.to(device),
        loss_index=torch.tensor(loss_index, dtype=torch.long, device=device),
        targets=torch.tensor([t for s in samples for t in s.targets], dtype=torch.long, device=device),
        old_logprobs=torch.tensor([x for s in samples for x in s.old_logprobs], **f32),
        advantages=torch.tensor([s.advantage for s in samples for _ in s.targets], **f32),
        seq_idx=torch.tensor(seq_idx, dtype=torch.long, device=device),
        mask=torch.ones(n, **f32),
        num_seqs=len(samples),
    )


def dummy_batch(device: torch.device | str = "cpu") -> MicroBatch:
    """One token, mask 0: runs every FSDP collective of a forward/backward and contributes exactly zero."""
    b = collate([Sample([0], [0], [0.0], 0.0)], device)
    b.mask.zero_()
    return b

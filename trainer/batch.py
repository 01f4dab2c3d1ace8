"""From GRPO groups to packed per-token tensors: samples, the split over train ranks, micro-batches by a token budget.

A trajectory becomes one packed sequence `prompt + response[:-1]`; the hidden state at position p predicts token
p + 1, so the last len(response) positions are the ones trained on (targets = the response, old log-probs = the
behaviour policy's, from `Trajectory.logprobs`). Every train rank computes the same plan from the same groups:
sequences go to ranks longest first onto the least loaded (balanced by tokens), then into micro-batches first-fit
decreasing under `micro_batch_tokens`. Ranks with fewer micro-batches than the busiest run zero-weight dummy ones,
because FSDP's collectives need every rank in every forward and backward.

With `train.share_prompts` the G samples of a group travel together (to one rank, into one micro-batch) and their
common prompt is packed once, every sample's own tokens after it (model/attention.py `SharedPrefixCausal`): the
log-probs and gradients are those of the unshared packing (up to float summation order), for P + G * (R - 1)
tokens instead of G * (P + R - 1).

Multi-turn episodes (rl/episode.py) carry a loss mask over their response (`Trajectory.loss_mask`: 1 = a model
token, 0 = an environment observation): observation tokens stay in the packed sequence (they condition every later
model token) and among the targets, with `MicroBatch.mask` 0, so they add nothing to the loss, its gradient, its
normaliser or any statistic. With shared prompts the prompt carries no mask (it has no targets but the first
response token's), and each sample's own tokens carry theirs. A trajectory without a mask trains every token.
"""
from __future__ import annotations

from array import array

from dataclasses import dataclass

import torch

from model.attention import (AttentionBackend, PackedCausal, SharedPrefixCausal, cu_seqlens_from_lengths,
                             positions_from_cu_seqlens)
from rl.advantages import Advantages


@dataclass
class Sample:
    tokens: list[int]           # model input: prompt + response[:-1]
    targets: list[int]          # the response: targets of the last len(targets) input positions
    old_logprobs: list[float]   # behaviour log-probs of the targets
    advantage: float
    group_id: int = -1
    versions: list[int] | None = None  # weight version of each target (Trajectory.versions); None: all 0
    loss_mask: list[int] | None = None  # per target: 1 trained, 0 an observation token (Trajectory); None: all 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_trained(self) -> int:
        """Targets trained on: the model's tokens (all of them without a loss mask)."""
        return len(self.targets) if self.loss_mask is None else sum(self.loss_mask)

    @property
    def prompt_len(self) -> int:
        return len(self.tokens) - len(self.targets) + 1


def build_samples(adv: Advantages) -> list[Sample]:
    """One Sample per trajectory with a non-empty response, in group order, with its loss mask (ValueError when the
    mask's length is not the response's or an entry is not 0 or 1)."""
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
            n = len(t.response_ids)
            mask = None
            if t.loss_mask is not None:
                if len(t.loss_mask) != n:
                    raise ValueError(f"group {group.group_id} sample {t.sample_index}: loss_mask has "
                                     f"{len(t.loss_mask)} entries for {n} response tokens")
                mask = [int(m) for m in t.loss_mask]
                if any(m not in (0, 1) for m in mask):
                    raise ValueError(f"group {group.group_id} sample {t.sample_index}: loss_mask entries must be "
                                     f"0 (observation) or 1 (model token), got {sorted(set(mask) - {0, 1})}")
            versions = list(t.versions[:n])
            versions += [versions[-1] if versions else 0] * (n - len(versions))
            out.append(Sample(list(t.prompt_ids) + list(t.response_ids[:-1]), list(t.response_ids),
                              list(t.logprobs), float(a), group.group_id, versions, mask))
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


def prompt_families(samples: list[Sample]) -> list[list[int]]:
    """Indices of the samples grouped by identical prompt (a GRPO group's G samples), in order of first appearance."""
    fams: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        fams.setdefault(tuple(s.tokens[:s.prompt_len]), []).append(i)
    return list(fams.values())


def shared_units(samples: list[Sample], budget: int) -> tuple[list[list[int]], list[int]]:
    """The samples as families sharing one prompt, each cut into pieces of at most `budget` packed tokens (the
    prompt counted once per piece; a piece holds at least one sample), with each piece's packed token count."""
    units: list[list[int]] = []
    costs: list[int] = []
    for fam in prompt_families(samples):
        P = samples[fam[0]].prompt_len
        piece: list[int] = []
        cost = P
        for i in fam:
            n = samples[i].num_tokens - P
            if piece and cost + n > budget:
                units.append(piece)
                costs.append(cost)
                piece, cost = [], P
            piece.append(i)
            cost += n
        units.append(piece)
        costs.append(cost)
    return units, costs


def plan_micro_batches(samples: list[Sample], world: int, budget: int, share_prompts: bool) -> list[list[list[int]]]:
    """Per train rank, its micro-batches as sample indices. Without sharing every sample is a unit of its own
    length; with it, a unit is a piece of a family (`shared_units`), so a group's samples stay together on one
    rank and in one micro-batch, where its prompt is packed once. Units go to ranks balanced by packed tokens,
    then into micro-batches first-fit decreasing under `budget`."""
    if share_prompts:
        units, costs = shared_units(samples, budget)
    else:
        units, costs = [[i] for i in range(len(samples))], [s.num_tokens for s in samples]
    return [[sorted(i for u in mb for i in units[u]) for mb in pack_micro_batches(mine, costs, budget)]
            for mine in assign_to_ranks(costs, world)]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor     # [T] packed inputs
    positions: torch.Tensor     # [T]
    attn: AttentionBackend      # who attends to whom in the packing (PackedCausal or SharedPrefixCausal)
    loss_index: torch.Tensor    # [N] positions in [0, T) whose next token is trained on
    targets: torch.Tensor       # [N]
    old_logprobs: torch.Tensor  # [N] fp32
    advantages: torch.Tensor    # [N] fp32
    seq_idx: torch.Tensor       # [N] int64 in [0, S)
    mask: torch.Tensor          # [N] fp32: 1 for trained tokens; 0 for observation tokens and in a dummy batch
    num_seqs: int
    versions: torch.Tensor | None = None  # [N] int64: the weight version of each target (staleness metrics)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.mask.sum().item())


def collate(samples: list[Sample], device: torch.device | str = "cpu", share_prompts: bool = False) -> MicroBatch:
    """One packed micro-batch. Each sample is `prompt + response[:-1]` end to end (PackedCausal); with
    `share_prompts` the samples that share a prompt are reordered together and their prompt is packed once, before
    every sample's own tokens (SharedPrefixCausal): the same log-probs and gradients, fewer tokens."""
    if share_prompts:
        return _collate_shared(samples, device)
    lengths = [s.num_tokens for s in samples]
    cu = cu_seqlens_from_lengths(lengths)
    loss_index, seq_idx = [], []
    for i, (s, start) in enumerate(zip(samples, cu[:-1].tolist())):
        first = start + s.num_tokens - len(s.targets)
        loss_index.extend(range(first, start + s.num_tokens))
        seq_idx.extend([i] * len(s.targets))
    return _micro_batch(samples, [t for s in samples for t in s.tokens], positions_from_cu_seqlens(cu).tolist(),
                        PackedCausal(cu.to(device)), loss_index, seq_idx, device)


def _collate_shared(samples: list[Sample], device: torch.device | str) -> MicroBatch:
    fams = prompt_families(samples)
    heads = [samples[fam[0]] for fam in fams]
    samples = [samples[i] for fam in fams for i in fam]
    plens = [h.prompt_len for h in heads]
    ids = [t for h, P in zip(heads, plens) for t in h.tokens[:P]]
    pos = [p for P in plens for p in range(P)]
    ends = cu_seqlens_from_lengths(plens)[1:].tolist()    # a family's last prompt position + 1
    child_lens, child_fam, loss_index, seq_idx = [], [], [], []
    i = 0
    for f, (fam, P) in enumerate(zip(fams, plens)):
        for _ in fam:
            s = samples[i]
            n = s.num_tokens - P
            loss_index.append(ends[f] - 1)                 # the prompt's last token predicts the first target
            loss_index.extend(range(len(ids), len(ids) + n))
            ids.extend(s.tokens[P:])
            pos.extend(range(P, P + n))
            seq_idx.extend([i] * len(s.targets))
            child_lens.append(n)
            child_fam.append(f)
            i += 1
    return _micro_batch(samples, ids, pos, SharedPrefixCausal(plens, child_lens, child_fam), loss_index, seq_idx,
                        device)


def _tensor(xs: list, typecode: str, device: torch.device | str) -> torch.Tensor:
    """A 1-D tensor of a list of Python numbers through an `array` ("q": int64, "f": fp32): torch.tensor reads a
    list element by element, ~4x slower at a micro-batch's ~17k entries (6.4 ms of collating a long-job micro-batch
    went to seven such tensors)."""
    dtype = torch.int64 if typecode == "q" else torch.float32
    if not xs:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.frombuffer(array(typecode, xs), dtype=dtype).to(device)


def _micro_batch(samples: list[Sample], ids: list[int], pos: list[int], attn: AttentionBackend,
                 loss_index: list[int], seq_idx: list[int], device: torch.device | str) -> MicroBatch:
    n = len(loss_index)
    targets, old, adv, versions = [], [], [], []
    masked = any(s.loss_mask is not None for s in samples)
    mask: list[float] = []
    for s in samples:
        targets += s.targets
        old += s.old_logprobs
        adv += [s.advantage] * len(s.targets)
        versions += s.versions if s.versions is not None else [0] * len(s.targets)
        if masked:
            mask += [1.0] * len(s.targets) if s.loss_mask is None else s.loss_mask
    return MicroBatch(
        input_ids=_tensor(ids, "q", device),
        positions=_tensor(pos, "q", device),
        attn=attn,
        loss_index=_tensor(loss_index, "q", device),
        targets=_tensor(targets, "q", device),
        old_logprobs=_tensor(old, "f", device),
        advantages=_tensor(adv, "f", device),
        seq_idx=_tensor(seq_idx, "q", device),
        mask=_tensor(mask, "f", device) if masked else torch.ones(n, dtype=torch.float32, device=device),
        num_seqs=len(samples),
        versions=_tensor(versions, "q", device),
    )


def dummy_batch(device: torch.device | str = "cpu") -> MicroBatch:
    """One token, mask 0: runs every FSDP collective of a forward/backward and contributes exactly zero."""
    b = collate([Sample([0], [0], [0.0], 0.0)], device)
    b.mask.zero_()
    return b

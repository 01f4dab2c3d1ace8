"""Attention backends: the one place where the trainer's and the engine's forward passes differ.

The model calls `backend(layer, q, k, v)` with packed (varlen) tensors: q [T, Hq, D], k/v [T, Hkv, D], where T is
the total number of new tokens of all sequences in the batch, and gets back [T, Hq, D]. What "causal" means is
the backend's business: `PackedCausal` attends within each packed sequence (training, parity tests); the engine's
paged backend (engine/attention.py) also attends to each sequence's cached prefix in the paged KV pool.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def uses_flash_varlen(q: torch.Tensor) -> bool:
    """Whether packed causal attention over `q` [T, H, D] runs a flash varlen kernel (`flash_varlen`): on CUDA in
    fp16 / bf16, with flash-attn importable or PyTorch's own flash kernel available for the device and head size;
    else a padded causal SDPA."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return False
    return HAS_FLASH_ATTN or _torch_flash_ok(q.device.index if q.device.index is not None
                                             else torch.cuda.current_device(), q.shape[-1])


@functools.lru_cache(maxsize=None)
def _torch_flash_ok(device_index: int, head_dim: int) -> bool:
    """PyTorch's bundled flash-attention 2 (aten._flash_attention_forward): built in, an sm80+ device, head_dim a
    multiple of 8 up to 256."""
    built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)()
    return (built and torch.cuda.get_device_capability(device_index) >= (8, 0) and head_dim % 8 == 0
            and head_dim <= 256)


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Causal attention over sequences packed end to end: query sequence i (rows cu_q[i]:cu_q[i + 1] of q [Tq, Hq,
    D]) over key sequence i of k, v [Tk, Hkv, D] (GQA when Hkv < Hq). Where a key sequence is longer than its query
    sequence the mask is aligned bottom-right: query j of n sees the keys up to position m - n + j of m, so queries
    that continue a prefix see all of it. flash-attn's kernel when importable, else PyTorch's own
    (aten._flash_attention_forward, whose autograd formula is its backward). cu_q, cu_k: int32 on q's device."""
    if HAS_FLASH_ATTN:
        from flash_attn import flash_attn_varlen_func
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True)
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                   scale=scale)[0]


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


# Who attends to whom in a packing, as rows a kernel can read in place (cpu/train_attention.py): a list of tasks,
# each a list of rows (first query token, query count, first prefix token, prefix count). Query i of a row sees
# the whole prefix and its own row's tokens up to i; a task is the rows whose keys share tokens (a prompt's row
# and its children's), so their key and value gradients are summed in one place.
RowSpans = list[list[tuple[int, int, int, int]]]


class _Derived:
    """A backend's memo of plans derived from it by whoever runs it (built on first use, reused by every layer and
    by the backward)."""

    def derived(self, key: str, build: Callable[[], Any]) -> Any:
        memo = self.__dict__.setdefault("_derived", {})
        if key not in memo:
            memo[key] = build()
        return memo[key]


def cu_seqlens_from_lengths(lengths: list[int] | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.int32, device=device)
    return F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[0, 1, ..., n0-1, 0, 1, ..., n1-1, ...] for packed sequences."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    total = int(cu_seqlens[-1])
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths.long(), output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


class PackedCausal(_Derived):
    """Causal self-attention within each of several sequences packed into one [T, ...] tensor.

    A flash varlen kernel on CUDA in fp16 / bf16 (`flash_varlen`: flash-attn's, else PyTorch's own); otherwise the
    sequences are scattered into a padded [B, Lmax] batch for one causal SDPA call (B * Lmax^2 work, never more
    than a T x T mask) and gathered back. Padding sits after each sequence's last token, so causal masking keeps
    real tokens from seeing it.
    """

    def __init__(self, cu_seqlens: torch.Tensor, scale: float | None = None):
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        self.lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        self.max_seqlen = max(self.lengths) if self.lengths else 0
        self.num_tokens = sum(self.lengths)
        self.scale = scale
        self._index: torch.Tensor | None = None

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str = "cpu") -> "PackedCausal":
        return cls(cu_seqlens_from_lengths(lengths, device))

    def _padded_index(self, device: torch.device) -> torch.Tensor:
        """Row of each packed token in the flattened [B * Lmax] padded batch."""
        if self._index is None:
            lengths = torch.tensor(self.lengths, device=device)
            seq = torch.repeat_interleave(torch.arange(len(self.lengths), device=device), lengths)
            pos = positions_from_cu_seqlens(self.cu_seqlens.to(device))
            self._index = seq * self.max_seqlen + pos
        return self._index

    def row_spans(self) -> RowSpans:
        """Each sequence a row of its own task, no prefix."""
        starts = self.cu_seqlens[:-1].tolist()
        return [[(s, n, 0, 0)] for s, n in zip(starts, self.lengths) if n]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        if uses_flash_varlen(q):
            cu = self.derived(f"cu:{q.device}", lambda: self.cu_seqlens.to(q.device))
            return flash_varlen(q, k, v, cu, cu, self.max_seqlen, self.max_seqlen, scale)
        if len(self.lengths) == 1:
            return _sdpa(q, k, v, scale, is_causal=True)
        B, L = len(self.lengths), self.max_seqlen
        idx = self._padded_index(q.device)

        def pad(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
            return x.new_zeros(B * L, *x.shape[1:]).index_copy(0, idx, x).view(B, L, *x.shape[1:]).transpose(1, 2)

        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2).reshape(B * L, *q.shape[1:]).index_select(0, idx)


class SharedPrefixCausal(_Derived):
    """Causal attention over a prefix-shared packing: a GRPO group's G samples share one prompt, which is laid out
    (and run through the model's projections and MLPs) once instead of G times.

    Layout of the packed [T, ...] tensors: every family's prompt, end to end (`prompt_lengths`, Tp tokens in all),
    then every child's own tokens, end to end (`child_lengths`; a child is one sample's response minus its last
    token, possibly empty). A prompt token attends causally within its prompt; a child token attends to the whole
    prompt of its family (`child_family`) and causally to its own earlier tokens. This equals packing each
    prompt + child as a separate sequence (PackedCausal) — a prompt token's state never depends on what follows
    it — and, since every child reads the one copy of its prompt's keys and values, the gradient that reaches the
    prompt is the sum over the children, as with G copies.

    Three ways:
      * varlen (CUDA in fp16 / bf16 with a flash kernel: `uses_flash_varlen`): two calls of `flash_varlen`. The
        prompts, packed end to end at the front, causally among themselves; then the children's queries, also
        packed end to end, each over its family's prompt followed by itself: only the keys and values are
        gathered (a child's key sequence is its prompt's tokens, then its own), and the kernel's bottom-right
        causal alignment lets every child query see the whole prompt and its own earlier tokens. The two outputs
        laid end to end are the packing's own order (no output gather, no prompt query computed twice); the
        prompt's key and value gradients are summed over its children by the gather's backward.
    Elsewhere, chosen per micro-batch by how much of it is prompt:
      * rows (short prompts, the GRPO norm): one causal call over rows, a row per non-empty child made of its
        family's prompt followed by the child (a family with no non-empty child gets a row of its prompt alone),
        gathered from the packed tensors into a padded batch, so the prompt's keys and values are shared and their
        gradients summed by the gather's backward. A row is an ordinary causal sequence, so the call takes SDPA's
        `is_causal` kernels with no mask in memory. A prompt's outputs are read from its family's first row; in the
        other rows its queries are computed again and dropped.
      * masked (long prompts): the prompts through one causal call, then each child's queries alone over its
        prompt's keys and its own under a [C, 1, Rmax, Pmax + Rmax] boolean mask: no prompt query computed twice,
        but the mask costs memory and keeps SDPA off its flash kernels.
    Rows while the prompts they copy are at most a share of the children's tokens (`rows_max_prompt_share`): a row
    computes (P + R)^2 query-key pairs where the masked call computes R (P + R), an excess that grows like P / R.
      * CPU, 0.25, measured (one layer's forward + backward, 8 prompts x 8 children of R = 256 tokens, head_dim 16,
        one thread), rows / masked: 74.8 / 83.6 ms at P = 32, 91.1 / 100.1 at P = 64, 119.0 / 115.2 at P = 96,
        208.1 / 168.6 at P = 256 (the mask's own cost repays the rows' excess up to about P = R / 4).
      * CUDA without a flash varlen kernel (fp32, an older device), always rows. The masked call (a boolean mask
        with GQA) has neither a flash nor a memory-efficient SDPA kernel there, so it materialises the
        probabilities: forced at P = 512, R = 1535 on the H200 (bench/results/gpu-h200.md) it took the 1.7B
        bench's peak from 52.9 to 75.0 GiB and its step from 2.20 to 2.63 s. Rows take SDPA's flash kernel and are
        what `train.py --check` plans; where prompts outweigh their children (P > R) they spend more attention
        FLOPs than the masked call would ((P + R)^2 / 2 pairs a row against R (P + R)), a trade taken for memory.
        The varlen way removes the rows' gathers of q and the output, their index_add backward and the copies
        around the padded call; on the H200 (2026-11-27, 1.7B bench, P = 512, R = 1535, equal lengths: no padding
        wasted) the step took the same time either way (2.01-2.16 s varlen, 2.08 s rows; the step is host-bound).
    The trainer's swapped model on CPU (fp32) takes neither way: `row_spans()` gives cpu/train_attention.py the
    same rows without a copy, a prompt's queries once (cpu/trainer.py, through trainer/fused.py).
    """

    ROWS_MAX_PROMPT_SHARE = {"cpu": 0.25, "cuda": float("inf")}
    VARLEN = True   # the varlen way where a flash varlen kernel runs (bench/train.py --shared-attention turns it off)

    def __init__(self, prompt_lengths: list[int], child_lengths: list[int], child_family: list[int],
                 scale: float | None = None):
        if not prompt_lengths or min(prompt_lengths) < 1:
            raise ValueError(f"every family needs a prompt of at least one token, got {prompt_lengths}")
        if len(child_lengths) != len(child_family) or any(not 0 <= f < len(prompt_lengths) for f in child_family):
            raise ValueError("child_family must name a family for each child")
        self.prompt_lengths, self.child_lengths, self.child_family = prompt_lengths, child_lengths, child_family
        self.num_prompt_tokens = sum(prompt_lengths)
        self.num_tokens = self.num_prompt_tokens + sum(child_lengths)
        kids = [c for c, n in enumerate(child_lengths) if n]
        alone = sorted(set(range(len(prompt_lengths))) - {child_family[c] for c in kids})
        # (family, child or -1) of each row: the children with tokens, then the families that have none
        self.row_of = [(child_family[c], c) for c in kids] + [(f, -1) for f in alone]
        self.rows = PackedCausal(cu_seqlens_from_lengths(
            [prompt_lengths[f] + (child_lengths[c] if c >= 0 else 0) for f, c in self.row_of]), scale)
        self.scale = scale
        # the prompt tokens the rows copy, per child token
        self.prompt_share = (sum(prompt_lengths[child_family[c]] for c in kids)
                             / max(1, sum(child_lengths[c] for c in kids)))
        self._plan: tuple[torch.Tensor, torch.Tensor] | None = None
        self._mask_plan: tuple[torch.Tensor, ...] | None = None
        self._prompts: PackedCausal | None = None   # the masked way's prompt call
        self._varlen: tuple[Any, ...] | None = None   # the varlen way's plan

    def _index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the packed token behind each position of the rows, the rows' position of each packed token's output),
        the rows padded into [rows, Lmax], a padding position reading token T (a zero row appended to the packed
        tensor)."""
        if self._plan is None:
            T = self.num_prompt_tokens + sum(self.child_lengths)
            width = self.rows.max_seqlen
            pstart = cu_seqlens_from_lengths(self.prompt_lengths).tolist()
            cstart = (cu_seqlens_from_lengths(self.child_lengths) + self.num_prompt_tokens).tolist()
            src: list[int] = []
            out_pos = [-1] * T
            for f, c in self.row_of:
                row = len(src)
                if out_pos[pstart[f]] < 0:   # the family's first row: its prompt's outputs
                    out_pos[pstart[f]:pstart[f + 1]] = range(row, row + pstart[f + 1] - pstart[f])
                src.extend(range(pstart[f], pstart[f + 1]))
                if c >= 0:
                    out_pos[cstart[c]:cstart[c + 1]] = range(len(src), len(src) + cstart[c + 1] - cstart[c])
                    src.extend(range(cstart[c], cstart[c + 1]))
                src.extend([T] * (row + width - len(src)))
            self._plan = (torch.tensor(src, dtype=torch.long, device=device),
                          torch.tensor(out_pos, dtype=torch.long, device=device))
        return self._plan

    def row_spans(self) -> RowSpans:
        """A task per family: its prompt's row (causal, computed once), then a row per child with tokens, whose
        prefix is that prompt (no copy, no query computed twice)."""
        pstart = cu_seqlens_from_lengths(self.prompt_lengths).tolist()
        cstart = (cu_seqlens_from_lengths(self.child_lengths) + self.num_prompt_tokens).tolist()
        tasks: RowSpans = [[(pstart[f], n, 0, 0)] for f, n in enumerate(self.prompt_lengths)]
        for c, (n, f) in enumerate(zip(self.child_lengths, self.child_family)):
            if n:
                tasks[f].append((cstart[c], n, pstart[f], self.prompt_lengths[f]))
        return tasks

    def use_rows(self, device: torch.device) -> bool:
        """Whether the rows (else the masked call) attend on this device where the varlen way does not (see the
        class docstring)."""
        return self.prompt_share <= self.ROWS_MAX_PROMPT_SHARE.get(device.type, self.ROWS_MAX_PROMPT_SHARE["cpu"])

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.VARLEN and uses_flash_varlen(q):
            return self.varlen(layer, q, k, v)
        return self.padded(layer, q, k, v) if self.use_rows(q.device) else self.masked(layer, q, k, v)

    def _varlen_plan(self, device: torch.device) -> tuple[Any, ...]:
        """(cu and max length of the prompts; cu and max length of the children with tokens, as queries; the packed
        token behind each of their keys, cu and max length of those key sequences), on `device`."""
        if self._varlen is None:
            pstart = cu_seqlens_from_lengths(self.prompt_lengths).tolist()
            cstart = (cu_seqlens_from_lengths(self.child_lengths) + self.num_prompt_tokens).tolist()
            kids = [c for c, n in enumerate(self.child_lengths) if n]
            src: list[int] = []
            for c in kids:
                f = self.child_family[c]
                src.extend(range(pstart[f], pstart[f + 1]))
                src.extend(range(cstart[c], cstart[c + 1]))
            qlens = [self.child_lengths[c] for c in kids]
            klens = [self.prompt_lengths[self.child_family[c]] + n for c, n in zip(kids, qlens)]
            self._varlen = (cu_seqlens_from_lengths(self.prompt_lengths, device), max(self.prompt_lengths),
                            cu_seqlens_from_lengths(qlens, device), max(qlens, default=0),
                            torch.tensor(src, dtype=torch.long, device=device),
                            cu_seqlens_from_lengths(klens, device), max(klens, default=0))
        return self._varlen

    def varlen(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The prompts causally, then the children's queries over their prompt's keys and their own, in two
        `flash_varlen` calls; their outputs end to end are the packing's order (see the class docstring)."""
        Tp = self.num_prompt_tokens
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        cu_p, max_p, cu_c, max_c, src, cu_kv, max_kv = self._varlen_plan(q.device)
        out_p = flash_varlen(q[:Tp], k[:Tp], v[:Tp], cu_p, cu_p, max_p, max_p, scale)
        if q.shape[0] == Tp:
            return out_p
        out_c = flash_varlen(q[Tp:], k.index_select(0, src), v.index_select(0, src), cu_c, cu_kv, max_c, max_kv,
                             scale)
        return torch.cat([out_p, out_c])

    def padded(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The rows gathered straight into a padded [rows, H, Lmax, D] batch for one causal SDPA call."""
        src, out_pos = self._index(q.device)
        B, L = len(self.rows.lengths), self.rows.max_seqlen

        def rows(x: torch.Tensor) -> torch.Tensor:   # [T, H, D] -> [B, H, L, D], padding zeros after each row
            x = torch.cat([x, x.new_zeros(1, *x.shape[1:])]).index_select(0, src)
            return x.view(B, L, *x.shape[1:]).transpose(1, 2)

        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        out = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), is_causal=True, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2).reshape(B * L, *q.shape[1:]).index_select(0, out_pos)


    def _masked_plan(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(prompt rows in the padded [F * Pmax] prompts, child rows in the padded [C' * Rmax] children, the
        family of each non-empty child, the [C', 1, Rmax, Pmax + Rmax] mask), C' the children with tokens."""
        if self._mask_plan is None:
            P, F_ = max(self.prompt_lengths), len(self.prompt_lengths)
            kids = [c for c, n in enumerate(self.child_lengths) if n]
            lens = torch.tensor([self.child_lengths[c] for c in kids], dtype=torch.long)
            plens = torch.tensor(self.prompt_lengths, dtype=torch.long)
            fam = torch.tensor([self.child_family[c] for c in kids], dtype=torch.long)
            R = int(lens.max()) if kids else 0
            prow = torch.repeat_interleave(torch.arange(F_), plens) * P + positions_from_cu_seqlens(
                cu_seqlens_from_lengths(self.prompt_lengths))
            crow = torch.repeat_interleave(torch.arange(len(kids)), lens) * R + positions_from_cu_seqlens(
                cu_seqlens_from_lengths(lens))
            sees_prompt = torch.arange(P)[None, :] < plens[fam][:, None]                    # [C', P]
            causal = torch.ones(R, R, dtype=torch.bool).tril()                               # [R, R]
            mask = torch.cat([sees_prompt[:, None, :].expand(-1, R, -1), causal.expand(len(kids), -1, -1)], -1)
            self._mask_plan = tuple(t.to(device) for t in (prow, crow, fam, mask[:, None]))
        return self._mask_plan

    def masked(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The prompts causally, then the children's queries over their prompt and themselves under a mask."""
        Tp = self.num_prompt_tokens
        if self._prompts is None:   # built once: every layer's call reuses its padding index
            self._prompts = PackedCausal(cu_seqlens_from_lengths(self.prompt_lengths, q.device), self.scale)
        out_p = self._prompts(layer, q[:Tp], k[:Tp], v[:Tp])
        if q.shape[0] == Tp:
            return out_p
        prow, crow, fam, mask = self._masked_plan(q.device)
        F_, P = len(self.prompt_lengths), max(self.prompt_lengths)
        C, R = mask.shape[0], mask.shape[2]
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5

        def pad(x: torch.Tensor, rows: torch.Tensor, n: int, L: int) -> torch.Tensor:   # [t, H, D] -> [n, L, H, D]
            return x.new_zeros(n * L, *x.shape[1:]).index_copy(0, rows, x).view(n, L, *x.shape[1:])

        def keys(x: torch.Tensor) -> torch.Tensor:   # [T, H, D] -> [C', H, P + R, D]: its prompt, then itself
            prompt = pad(x[:Tp], prow, F_, P).index_select(0, fam)
            return torch.cat([prompt, pad(x[Tp:], crow, C, R)], 1).transpose(1, 2)

        out = F.scaled_dot_product_attention(pad(q[Tp:], crow, C, R).transpose(1, 2), keys(k), keys(v),
                                             attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        return torch.cat([out_p, out.transpose(1, 2).reshape(C * R, *q.shape[1:]).index_select(0, crow)])

def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          is_causal: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H, D] in and out; GQA through SDPA's enable_gqa."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, is_causal=is_causal,
        scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(0, 1)

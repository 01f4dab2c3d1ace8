"""CPU engines: the model's Linear layers compute through oneDNN with pre-packed weights, while the engine runs it.

On CPU, `F.linear` calls MKL's sgemm on the weight as stored; for the small batches of a decode step (a few to a
few hundred rows) oneDNN's inner-product primitive on a weight reordered once into its blocked layout can be
faster on the same fp32 math (1.7-1.9x at 8 rows from 1024 x 1024 up on the 2-core EPYC VM; on small weights it is
slower, see PackedLinears). The engine keeps the model a plain `nn.Module` with its Hugging Face parameters:
`PackedLinears(model)` makes each `nn.Linear` a `PackedLinear` (same parameters, same state dict; outside the
engine's forward it is exactly `nn.Linear`) and holds the packed copy of each large weight. Only inside
`with packed.active():` (the runner's forward) do those layers use the packed copies (the small ones MKL on rows
padded to a multiple of 8), so a trainer, a test or a deep copy that runs the same modules computes with `F.linear`
as before. Both engine paths give a row the same bits whatever batch it is in: a sequence's tokens do not depend
on what it decodes beside (KV migration and resume rely on it).

Staleness: `repack()` after weights change (the runner's `load_weights` calls it). As a guard, a packed layer whose
weight was modified in place since packing (its version counter moved) or replaced falls back to `padded_linear`.
fp32 only; other dtypes, or a torch without the oneDNN ops, keep `F.linear` (`available()`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

_state = threading.local()  # .packed: {id(layer): _Packed} of the engine forward running in this thread


def available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class _Packed:
    __slots__ = ("weight", "version", "ptr")

    def __init__(self, layer: nn.Linear, batch_hint: int):
        w = layer.weight.detach()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        self.version, self.ptr = layer.weight._version, w.data_ptr()

    def fresh(self, layer: nn.Linear) -> bool:
        return layer.weight._version == self.version and layer.weight.data_ptr() == self.ptr


CHUNK = 256  # rows per oneDNN call at most


def row_pieces(m: int) -> list[tuple[int, int]]:
    """How m rows are computed: (rows, rows computed) pieces, each computed row count one of a few sizes.

    oneDNN builds (and caches, about half a MB each) one primitive per distinct row count, so computing whatever
    count a step brings would grow memory with every new batch or prefill size. Instead: whole CHUNKs, then a
    multiple of 32 when more than 64 rows are left, then the rest padded to a multiple of 8 (at most 7 padding
    rows). That is at most 15 row counts per weight shape: 8, 16, ..., 64, 96, ..., 224, 256."""
    out = [(CHUNK, CHUNK)] * (m // CHUNK)
    r = m % CHUNK
    if r > 64:
        out.append((r // 32 * 32, r // 32 * 32))
        r %= 32
    if r:
        out.append((r, -(-r // 8) * 8))
    return out


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, w, bias) with w pre-packed by `_reorder_linear_weight`, over row pieces of `row_pieces`."""
    x2 = x.reshape(-1, x.shape[-1])
    outs, i = [], 0
    for rows, computed in row_pieces(x2.shape[0]):
        xi = x2[i:i + rows]
        if computed > rows:
            xi = F.pad(xi, (0, 0, 0, computed - rows))
        outs.append(torch.ops.mkldnn._linear_pointwise(xi, weight, bias, "none", [], "")[:rows])
        i += rows
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear over the rows padded to a multiple of 8: MKL's sgemm then gives each row the same bits whatever
    the row count and the row's place (unpadded, 1-3 rows take another kernel), so a sequence's logits do not
    depend on the batch it decodes in (tests/cpu/test_cpu_linear.py checks it)."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if m % 8:
        x2 = F.pad(x2, (0, 0, 0, 8 - m % 8))
    return F.linear(x2, weight, bias)[:m].reshape(*x.shape[:-1], weight.shape[0])


_PADDED = object()   # table entry of a layer too small to pack: padded_linear


class PackedLinear(nn.Linear):
    """nn.Linear whose forward, inside the engine's forward in this thread, uses its packed weight (or
    `padded_linear` when it is too small to pack, or its packed copy is stale)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = getattr(_state, "packed", None)
        p = table.get(id(self)) if table is not None else None
        if p is None or x.numel() == 0:
            return F.linear(x, self.weight, self.bias)
        if p is _PADDED or not p.fresh(self):
            return padded_linear(x, self.weight, self.bias)
        return packed_linear(x, p.weight, self.bias)


class PackedLinears:
    """The model's fp32 CPU Linear layers with at least `min_weight` weight elements, packed; smaller ones compute
    `padded_linear` (MKL's sgemm, batch-invariant like the packed path). Why not pack them: measured on a 2-core
    AMD EPYC VM (one thread), oneDNN's call costs ~40 us more than MKL's sgemm on a 64 x 64 weight (7.5 vs 47 us at 8
    rows, 41 vs 74 us at 256) and a reorder costs ~0.35 ms per weight and load; from 1024 x 1024 up it wins at few
    rows (1.7-1.9x at 8) and is within 10% either way at 64-256 rows."""

    def __init__(self, model: nn.Module, batch_hint: int = 64, min_weight: int = 0):
        self.batch_hint = batch_hint
        self.layers: list[nn.Linear] = []   # packed
        self.small: list[nn.Linear] = []    # padded_linear
        for m in model.modules():
            if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
                if type(m) is nn.Linear:
                    m.__class__ = PackedLinear
                (self.layers if m.weight.numel() >= min_weight else self.small).append(m)
        self.packed: dict[int, object] = {}
        self.repack()

    @torch.no_grad()
    def repack(self) -> None:
        """Reorder every packed layer's current weight into oneDNN's layout (after a weight load)."""
        self.packed = {**{id(m): _PADDED for m in self.small}, **{id(m): _Packed(m, self.batch_hint)
                                                                    for m in self.layers}}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        prev = getattr(_state, "packed", None)
        _state.packed = self.packed
        try:
            yield
        finally:
            _state.packed = prev

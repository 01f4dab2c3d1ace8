"""Weight publication: trainer -> rollout engines after an update.

Every train rank calls `WeightPublisher.publish(version)` together: each parameter is gathered whole with
`DTensor.full_tensor()` inside the train group (not `get_model_state_dict` with `full_state_dict=True,
cpu_offload=True`, which gives the values to global rank 0 only, an empty dict to every other rank: PyTorch's
`StateDictOptions`), in buckets of about `bucket_bytes`. The train leader (train group rank 0) packs each bucket
into one byte buffer and broadcasts it over the publication group (train leader + rollout ranks; NCCL on GPU, gloo
on CPU). Receivers call `WeightReceiver.receive(loader)` and get `loader(iterable of (name, tensor), version)` (the
engine's `load_weights`), streamed bucket by bucket.

Wire format: one header object {version, names, shapes, dtypes, buckets, offsets, tied, verify}, then per bucket
one uint8 buffer (each tensor's bytes at a 16-byte aligned offset) and, with `verify`, one int64 [2, n] tensor of
per-tensor checksums (float64 sum bit-cast, and a positional hash of the bytes). The receiver checks each tensor
before handing its bucket to the loader, keeps receiving to the end (so the collectives stay matched) and raises
`WeightChecksumError` naming the first mismatching tensor. A tied weight is sent once, under its first name
(`model.embed_tokens.weight`); the header's `tied` maps the other names to it. Both sides tell `progress` (when
given) of the header and of each bucket: the runtime's deadlines are renewed by it (runtime/watchdog.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.fsdp import full_tensor, unique_parameters

ALIGN = 16
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
_HASH_MUL = 0x1E3779B97F4A7C15  # < 2**63 so it is an int64; products wrap mod 2**64 identically on every device


class WeightChecksumError(RuntimeError):
    """A published tensor arrived with bytes different from those sent."""


def tied_names(model: nn.Module) -> dict[str, str]:
    """Parameter names that alias an earlier one (lm_head.weight -> model.embed_tokens.weight when tied)."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def plan_buckets(nbytes: list[int], bucket_bytes: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Consecutive tensors per bucket (a tensor larger than bucket_bytes alone); each tensor's byte offset in its
    bucket (aligned); each bucket's total size."""
    buckets: list[list[int]] = [[]]
    offsets, sizes, used = [], [0], 0
    for i, n in enumerate(nbytes):
        if buckets[-1] and used + n > bucket_bytes:
            buckets.append([])
            sizes.append(0)
            used = 0
        offsets.append(used)
        buckets[-1].append(i)
        used = -(-(used + n) // ALIGN) * ALIGN
        sizes[-1] = used
    return ([b for b in buckets if b], offsets, [s for s, b in zip(sizes, buckets) if b])


def checksum(t: torch.Tensor, chunk: int = 1 << 22) -> tuple[float, int]:
    """(float64 sum of the values, a positional hash of the bytes mod 2**64 as a signed int64)."""
    total = float(t.detach().double().sum()) if t.numel() else 0.0
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    h = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, raw.numel(), chunk):
        b = raw[start:start + chunk].to(torch.int64)
        pos = torch.arange(start, start + b.numel(), dtype=torch.int64, device=t.device)
        h += (b * ((pos * _HASH_MUL) | 1)).sum()
    return total, int(h)


def pack_bucket(tensors: list[torch.Tensor], offsets: list[int], size: int, device: torch.device) -> torch.Tensor:
    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    for t, off in zip(tensors, offsets):
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        buf[off:off + raw.numel()].copy_(raw)
    return buf


def unpack_bucket(buf: torch.Tensor, bucket: list[int], header: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of one received bucket: views into `buf` with the header's dtypes and shapes."""
    out = []
    for i in bucket:
        dtype, shape = DTYPES[header["dtypes"][i]], torch.Size(header["shapes"][i])
        off = header["offsets"][i]
        out.append(buf[off:off + dtype.itemsize * shape.numel()].view(dtype).view(shape))
    return out


def _object_device(group: dist.ProcessGroup) -> torch.device | None:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None


class WeightPublisher:
    def __init__(self, model: nn.Module, pub_group: dist.ProcessGroup | None, train_group: dist.ProcessGroup | None
                 = None, *, bucket_bytes: int = 256 << 20, dtype: torch.dtype | None = None, verify: bool = False,
                 progress: Callable[[str], None] | None = None):
        """All train ranks build one. pub_group: train leader + rollout ranks (None on the other train ranks).
        dtype: what the engines run in (e.g. torch.bfloat16); None sends the parameters' own dtype."""
        self.model, self.pub_group, self.verify, self.bucket_bytes = model, pub_group, verify, bucket_bytes
        self.progress = progress or (lambda note: None)
        self.train_group = train_group or dist.group.WORLD
        self.leader = dist.get_rank(self.train_group) == 0
        self.src = dist.get_global_rank(self.train_group, 0) if self.train_group is not dist.group.WORLD else 0
        if self.leader and pub_group is None:
            raise ValueError("the train leader needs the publication group")
        self.params = unique_parameters(model)
        self.dtypes = [dtype or p.dtype for _, p in self.params]
        nbytes = [p.numel() * d.itemsize for (_, p), d in zip(self.params, self.dtypes)]
        self.buckets, self.offsets, self.sizes = plan_buckets(nbytes, bucket_bytes)

    def _header(self, version: int) -> dict[str, Any]:
        return {"version": int(version), "names": [n for n, _ in self.params],
                "shapes": [tuple(p.shape) for _, p in self.params], "dtypes": [str(d) for d in self.dtypes],
                "buckets": self.buckets, "offsets": self.offsets, "sizes": self.sizes,
                "tied": tied_names(self.model), "verify": self.verify}

    def _send_bucket(self, buf: torch.Tensor, check: torch.Tensor | None) -> None:
        dist.broadcast(buf, src=self.src, group=self.pub_group)
        if check is not None:
            dist.broadcast(check, src=self.src, group=self.pub_group)

    def _gather_bucket(self, bucket: list[int], size: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Full tensors of one bucket (a collective on the train group); on the leader, packed into one new byte
        buffer plus its checksums: a copy, so training may go on while it is sent."""
        tensors = [full_tensor(self.params[i][1].detach()).to(self.dtypes[i]) for i in bucket]
        if not self.leader:
            return None
        buf = pack_bucket(tensors, [self.offsets[i] for i in bucket], size, tensors[0].device)
        check = None
        if self.verify:
            sums = [checksum(t) for t in tensors]
            check = torch.stack([torch.tensor([s for s, _ in sums], dtype=torch.float64).view(torch.int64),
                                 torch.tensor([h for _, h in sums], dtype=torch.int64)]).to(buf.device)
        return buf, check

    @torch.no_grad()
    def publish(self, version: int) -> dict[str, float]:
        """Gather and broadcast bucket by bucket (peak memory: one bucket)."""
        t0 = time.perf_counter()
        if self.leader:
            dist.broadcast_object_list([self._header(version)], src=self.src, group=self.pub_group,
                                       device=_object_device(self.pub_group))
            self.progress(f"v{version}: header sent")
        for i, (bucket, size) in enumerate(zip(self.buckets, self.sizes)):
            packed = self._gather_bucket(bucket, size)
            if packed is not None:
                self._send_bucket(*packed)
            self.progress(f"v{version}: bucket {i + 1}/{len(self.buckets)} {'sent' if self.leader else 'gathered'}")
        return {"version": float(version), "bytes": float(sum(self.sizes)) if self.leader else 0.0,
                "buckets": float(len(self.buckets)), "seconds": time.perf_counter() - t0}

    @torch.no_grad()
    def pack(self, version: int) -> PackedWeights | None:
        """The gathering half of an overlapped publication (every train rank; collective on the train group): the
        leader keeps every bucket packed (a full copy of the weights), to `send` while the next step trains."""
        t0 = time.perf_counter()
        buckets = []
        for i, (b, s) in enumerate(zip(self.buckets, self.sizes)):
            buckets.append(self._gather_bucket(b, s))
            self.progress(f"v{version}: bucket {i + 1}/{len(self.buckets)} gathered")
        if not self.leader:
            return None
        return PackedWeights(int(version), buckets, time.perf_counter() - t0)  # type: ignore[arg-type]

    @torch.no_grad()
    def send(self, weights: PackedWeights) -> dict[str, float]:
        """The sending half (leader + rollout ranks, on the publication group only): safe beside a train step."""
        t0 = time.perf_counter()
        dist.broadcast_object_list([self._header(weights.version)], src=self.src, group=self.pub_group,
                                   device=_object_device(self.pub_group))
        self.progress(f"v{weights.version}: header sent")
        for i, (buf, check) in enumerate(weights.buckets):
            self._send_bucket(buf, check)
            self.progress(f"v{weights.version}: bucket {i + 1}/{len(weights.buckets)} sent")
        return {"version": float(weights.version), "bytes": float(sum(self.sizes)),
                "buckets": float(len(self.buckets)), "seconds": time.perf_counter() - t0, "gather_s": weights.gather_s}


@dataclass
class PackedWeights:
    """Packed buckets of one version's weights, held by the leader until they are sent."""
    version: int
    buckets: list[tuple[torch.Tensor, torch.Tensor | None]]
    gather_s: float


class WeightReceiver:
    def __init__(self, pub_group: dist.ProcessGroup, src: int, device: torch.device | str = "cpu",
                 progress: Callable[[str], None] | None = None):
        """src: the global rank of the train leader."""
        self.group, self.src, self.device = pub_group, src, torch.device(device)
        self.progress = progress or (lambda note: None)

    def receive(self, loader: Callable[[Iterable[tuple[str, torch.Tensor]], int], Any]) -> int:
        """Receive one publication and hand it to `loader`; returns its version."""
        holder: list[Any] = [None]
        dist.broadcast_object_list(holder, src=self.src, group=self.group, device=_object_device(self.group))
        header = holder[0]
        self.progress(f"v{header['version']}: header received")
        stream = self._stream(header)
        try:
            loader(stream, header["version"])
        finally:
            for _ in stream:  # whatever the loader did not consume, so every broadcast is matched
                pass
        return header["version"]

    def _stream(self, h: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        bad = None
        for i, (bucket, size) in enumerate(zip(h["buckets"], h["sizes"])):
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            dist.broadcast(buf, src=self.src, group=self.group)
            self.progress(f"v{h['version']}: bucket {i + 1}/{len(h['buckets'])} received")
            tensors = unpack_bucket(buf, bucket, h)
            if h["verify"]:
                check = torch.empty(2, len(bucket), dtype=torch.int64, device=self.device)
                dist.broadcast(check, src=self.src, group=self.group)
                sums, hashes = check[0].view(torch.float64).tolist(), check[1].tolist()
                for j, (i, t) in enumerate(zip(bucket, tensors)):
                    got_sum, got_hash = checksum(t)
                    if bad is None and (got_hash != hashes[j] or abs(got_sum - sums[j]) > 1e-6 * (1 + abs(sums[j]))):
                        bad = (f"published weights v{h['version']}: tensor {h['names'][i]!r} arrived corrupted "
                               f"(sum {got_sum!r} vs sent {sums[j]!r}, hash {got_hash} vs sent {hashes[j]})")
            if bad is None:
                yield from ((h["names"][i], t) for i, t in zip(bucket, tensors))
        if bad is not None:
            raise WeightChecksumError(bad)

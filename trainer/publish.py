"""Weight publication: trainer -> rollout engines after an update.

Every train rank calls `WeightPublisher.publish(version)` together: each parameter is gathered whole with
`DTensor.full_tensor()` inside the train group (not `get_model_state_dict` with `full_state_dict=True,
cpu_offload=True`, which gives the values to global rank 0 only, an empty dict to every other rank: PyTorch's
`StateDictOptions`), in buckets of about `bucket_bytes`. The train leader (train group rank 0) packs each bucket
into one byte buffer, copies it to host memory and broadcasts it over the publication group (train leader + rollout
ranks): publications travel in host memory whatever the device, so on GPU they go over the group's gloo backend and
land in the rollout ranks' CPU relays without touching an engine's GPU memory or its SMs (Laminar §2.4 C1, §4; a
CUDA buffer on one side and a CPU one on the other would put the two ends on different backends, NCCL and gloo,
and hang). Receivers call `WeightReceiver.receive(loader)` and get `loader(iterable of (name, tensor), version)` (the
engine's `load_weights`), streamed bucket by bucket.

Routes (`cluster.relay`): `broadcast` (every piece one broadcast from the train leader to every rollout rank) or
`chain` (Laminar App. C's relays: the leader sends each piece to the first rollout rank only, the master relay, and
each relay forwards it to the next while it receives the piece after it, so the trainer's stall is one copy
whatever the number of rollout ranks, and the pieces flow down the chain pipelined bucket by bucket). The pieces are
the same either way.

Wire format: one int64 pair per publication, [version, header bytes]; the header {names, shapes, dtypes, buckets,
offsets, sizes, tied, verify} (JSON: no unpickling outside the control channel) follows only on the first
publication, which the receiver keeps, since the layout never changes. Then per bucket one uint8 buffer: each
tensor's bytes at a 16-byte aligned offset and, with `verify`, after them one int64 checksum per tensor (`checksum`:
a positional hash of its bytes, taken from the gathered tensor before packing). So a publication is two broadcasts
plus one per bucket, whatever the number of tensors. The receiver checks each tensor before handing its bucket to
the loader, keeps receiving to the end (so the collectives stay matched) and raises `WeightChecksumError` naming the
first mismatching tensor; `hashes` keeps the verified checksums of the last publication (the rollout worker checks
its engine against them after a load). A tied weight is sent once, under its first name
(`model.embed_tokens.weight`); the header's `tied` maps the other names to it. Both sides tell `progress` (when
given) of the header and of each bucket: the runtime's deadlines are renewed by it (runtime/watchdog.py).
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


ALIGN = 16
RELAY_TAG = 31     # the chain's point-to-point pieces on the publication group
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
_HASH_MUL = 0x1E3779B97F4A7C15  # < 2**63 so it is an int64; products wrap mod 2**64 identically on every device
_MASK = (1 << 64) - 1


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


_weights: dict[torch.device, torch.Tensor] = {}
_weights_lock = threading.Lock()


def _hash_weights(n: int, device: torch.device) -> torch.Tensor:
    """(2i + 1) * _HASH_MUL mod 2**64 for i < n: odd, so a change of any one word always changes the hash; cached
    per device and grown on demand."""
    with _weights_lock:
        w = _weights.get(device)
        if w is None or w.numel() < n:
            m = max(n, 2 * (w.numel() if w is not None else 0), 1 << 12)
            w = (torch.arange(m, dtype=torch.int64, device=device) * 2 + 1) * _HASH_MUL
            _weights[device] = w
        return w[:n]


def checksum(t: torch.Tensor, chunk: int = 1 << 20) -> int:
    """A positional hash of the tensor's bytes: sum over its 8-byte words (the last zero-padded) of word_i *
    (2i + 1) * _HASH_MUL, mod 2**64, as a signed int64. Two fused ops per `chunk` words over a cached weight
    vector: word i of a chunk starting at word s weighs w_i + 2s * _HASH_MUL, so chunks need only the first
    `chunk` weights. Any single changed word changes it; swapped words change it (positional)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 8:
        raw = torch.cat([raw, raw.new_zeros(8 - raw.numel() % 8)])
    elif raw.storage_offset() % 8:   # a view into the middle of a word: int64 needs aligned storage
        raw = raw.clone()
    words = raw.view(torch.int64)
    h = 0
    for s in range(0, words.numel(), chunk):
        w = words[s:s + chunk]
        h += int((w * _hash_weights(w.numel(), w.device)).sum())
        if s:
            h += 2 * s * _HASH_MUL * int(w.sum())
    h &= _MASK
    return h - (1 << 64) if h >= 1 << 63 else h


def pack_bucket(tensors: list[torch.Tensor], offsets: list[int], size: int, device: torch.device) -> torch.Tensor:
    """One byte buffer of `size` (zero padding; room after the tensors stays zero)."""
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
                 progress: Callable[[str], None] | None = None, chain: list[int] | None = None):
        """All train ranks build one. pub_group: train leader + rollout ranks (None on the other train ranks).
        dtype: what the engines run in (e.g. torch.bfloat16); None sends the parameters' own dtype. chain: the
        rollout ranks (global) in relay order, to send to the first one only; None: broadcast to all."""
        self.model, self.pub_group, self.verify, self.bucket_bytes = model, pub_group, verify, bucket_bytes
        if chain is not None and not chain:
            raise ValueError("a relay chain needs at least one rollout rank")
        self.chain = chain
        self.progress = progress or (lambda note: None)
        self.train_group = train_group or dist.group.WORLD
        self.leader = dist.get_rank(self.train_group) == 0
        self.src = dist.get_global_rank(self.train_group, 0) if self.train_group is not dist.group.WORLD else 0
        if self.leader and pub_group is None:
            raise ValueError("the train leader needs the publication group")
        from trainer.fsdp import unique_parameters  # here: a rollout rank (WeightReceiver) needs no FSDP2
        self.params = unique_parameters(model)
        self.dtypes = [dtype or p.dtype for _, p in self.params]
        nbytes = [p.numel() * d.itemsize for (_, p), d in zip(self.params, self.dtypes)]
        self.buckets, self.offsets, self.sizes = plan_buckets(nbytes, bucket_bytes)
        self.header_sent = False   # the layout goes with the first publication only

    def _header(self) -> dict[str, Any]:
        return {"names": [n for n, _ in self.params],
                "shapes": [tuple(p.shape) for _, p in self.params], "dtypes": [str(d) for d in self.dtypes],
                "buckets": self.buckets, "offsets": self.offsets, "sizes": self.sizes,
                "tied": tied_names(self.model), "verify": self.verify}

    def _send_header(self, version: int) -> None:
        """[version, n] then, on the first publication only, the n bytes of the layout as JSON."""
        raw = b"" if self.header_sent else json.dumps(self._header()).encode()
        device = _object_device(self.pub_group) or torch.device("cpu")
        self._out(torch.tensor([int(version), len(raw)], dtype=torch.int64, device=device))
        if raw:
            self._out(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device))
        self.header_sent = True
        self.progress(f"v{version}: header sent")

    def _gather_bucket(self, bucket: list[int], size: int) -> torch.Tensor | None:
        """Full tensors of one bucket (one all-gather on the train group); on the leader, packed into one new byte
        buffer with their checksums after them: a copy, so training may go on while it is sent."""
        from trainer.fsdp import gather_full
        tensors = [t.to(self.dtypes[i]) for i, t in zip(bucket, gather_full([self.params[i][1].detach()
                                                                                for i in bucket]))]
        if not self.leader:
            return None
        total = size + (8 * len(bucket) if self.verify else 0)
        buf = pack_bucket(tensors, [self.offsets[i] for i in bucket], total, tensors[0].device)
        if self.verify:  # of the gathered tensors, not of the packed bytes: a bad pack is caught too
            buf[size:].view(torch.int64).copy_(torch.tensor([checksum(t) for t in tensors], dtype=torch.int64))
        return buf.cpu()   # publications travel in host memory (module docstring); a no-op on CPU

    def _out(self, t: torch.Tensor) -> None:
        """One piece from the leader: to every rollout rank, or to the chain's first relay only."""
        if self.chain is None:
            dist.broadcast(t, src=self.src, group=self.pub_group)
        else:
            dist.send(t, self.chain[0], group=self.pub_group, tag=RELAY_TAG)

    @torch.no_grad()
    def publish(self, version: int) -> dict[str, float]:
        """Gather and broadcast bucket by bucket (peak memory: one bucket)."""
        t0 = time.perf_counter()
        if self.leader:
            self._send_header(version)
        for i, (bucket, size) in enumerate(zip(self.buckets, self.sizes)):
            packed = self._gather_bucket(bucket, size)
            if packed is not None:
                self._out(packed)
            self.progress(f"v{version}: bucket {i + 1}/{len(self.buckets)} {'sent' if self.leader else 'gathered'}")
        return {"version": float(version), "bytes": float(sum(self.sizes)) if self.leader else 0.0,
                "buckets": float(len(self.buckets)), "seconds": time.perf_counter() - t0}

    @torch.no_grad()
    def pack(self, version: int) -> PackedWeights | None:
        """The gathering half of an overlapped publication (every train rank; collective on the train group): the
        leader keeps every bucket packed in host memory (a full copy of the weights), to `send` while the next step
        trains."""
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
        self._send_header(weights.version)
        for i, buf in enumerate(weights.buckets):
            self._out(buf)
            self.progress(f"v{weights.version}: bucket {i + 1}/{len(weights.buckets)} sent")
        return {"version": float(weights.version), "bytes": float(sum(self.sizes)),
                "buckets": float(len(self.buckets)), "seconds": time.perf_counter() - t0, "gather_s": weights.gather_s}


@dataclass
class PackedWeights:
    """Packed buckets of one version's weights, held by the leader until they are sent."""
    version: int
    buckets: list[torch.Tensor]     # packed bytes, checksums after them when verified
    gather_s: float


class WeightReceiver:
    def __init__(self, pub_group: dist.ProcessGroup, src: int, device: torch.device | str = "cpu",
                 progress: Callable[[str], None] | None = None, chain: list[int] | None = None):
        """src: the global rank of the train leader. chain: the rollout ranks (global) in relay order, this rank
        among them: receive each piece from the one before (the leader for the first) and forward it to the one
        after; None: join the leader's broadcasts."""
        self.group, self.src, self.device = pub_group, src, torch.device(device)
        self.progress = progress or (lambda note: None)
        self.header: dict[str, Any] | None = None    # the layout, from the first publication
        self.hashes: dict[str, int] = {}             # verified checksums of the last publication (when verified)
        self.prev = self.next = None
        if chain is not None:
            me = dist.get_rank()
            if me not in chain:
                raise ValueError(f"rank {me} receives from a relay chain {chain} it is not part of")
            i = chain.index(me)
            self.prev, self.next = (src if i == 0 else chain[i - 1]), (chain[i + 1] if i + 1 < len(chain) else None)
        self.forwards: list[dist.Work] = []          # this publication's pieces on their way to the next relay

    @property
    def peers(self) -> list[int]:
        """The global ranks a receive waits on: the leader, or the chain's relays before and after this one."""
        if self.prev is None:
            return [self.src]
        return [self.prev] + ([self.next] if self.next is not None else [])

    def _in(self, t: torch.Tensor) -> torch.Tensor:
        """One piece into `t`: from the leader's broadcast, or from the relay before (then on to the next one,
        without waiting: the next piece is received meanwhile)."""
        if self.prev is None:
            dist.broadcast(t, src=self.src, group=self.group)
        else:
            dist.recv(t, self.prev, group=self.group, tag=RELAY_TAG)
            if self.next is not None:
                self.forwards.append(dist.isend(t, self.next, group=self.group, tag=RELAY_TAG))
        return t

    def receive(self, loader: Callable[[Iterable[tuple[str, torch.Tensor]], int], Any]) -> int:
        """Receive one publication and hand it to `loader`; returns its version."""
        device = _object_device(self.group) or torch.device("cpu")
        head = self._in(torch.empty(2, dtype=torch.int64, device=device))
        version, n = (int(x) for x in head.tolist())
        if n:
            raw = self._in(torch.empty(n, dtype=torch.uint8, device=device))
            self.header = json.loads(raw.cpu().numpy().tobytes().decode())
        if self.header is None:
            raise RuntimeError(f"weights v{version} arrived without their layout (the first publication was missed)")
        self.progress(f"v{version}: header received")
        self.hashes = {}
        stream = self._stream(self.header, version)
        try:
            loader(stream, version)
        finally:
            for _ in stream:  # whatever the loader did not consume, so every broadcast is matched
                pass
            forwards, self.forwards = self.forwards, []
            for work in forwards:   # the next relay has every piece before this publication counts as done
                work.wait()
        return version

    def _stream(self, h: dict[str, Any], version: int) -> Iterator[tuple[str, torch.Tensor]]:
        bad = None
        for i, (bucket, size) in enumerate(zip(h["buckets"], h["sizes"])):
            buf = self._in(torch.empty(size + (8 * len(bucket) if h["verify"] else 0), dtype=torch.uint8,
                                       device=self.device))
            self.progress(f"v{version}: bucket {i + 1}/{len(h['buckets'])} received")
            tensors = unpack_bucket(buf, bucket, h)
            if h["verify"]:
                sent = buf[size:].view(torch.int64).tolist()
                for j, (k, t) in enumerate(zip(bucket, tensors)):
                    got = checksum(t)
                    if bad is None and got != sent[j]:
                        bad = (f"published weights v{version}: tensor {h['names'][k]!r} arrived corrupted "
                               f"(hash {got} vs sent {sent[j]})")
                    self.hashes[h["names"][k]] = got
            if bad is None:
                yield from ((h["names"][k], t) for k, t in zip(bucket, tensors))
        if bad is not None:
            raise WeightChecksumError(bad)

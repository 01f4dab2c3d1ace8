"""A rollout rank's relay (Laminar §4: relays off the decode path): the CPU copy of the newest publication, which
the engine adopts when the weight-sync policy says so.

A ReceiveWeights joins the publication broadcast on the relay's thread while the engine decodes on; the relay fills
whole once the publication is in (`weights_received`: seconds, tokens decoded meanwhile). A LoadWeights copies the
relay into the engine: the relay holds only the newest publication, so the engine adopts that one, at least the
version asked for (`weights_loaded` says which). With `cluster.verify_weights` the relay keeps each tensor's checksum
(the trainer's, as the receiver got them, else taken here) and the engine's tensors are checked against them after
every load: the run stops naming the first tensor that differs.

Invariant kept: the relay is replaced whole, never partly (a publication still arriving is not in it).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch

from engine.engine import LLMEngine
from runtime.background import InOrder
from runtime.watchdog import Phase, waiting
from trainer.publish import WeightReceiver, checksum


class WeightMismatchError(RuntimeError):
    """An engine's weights differ from what the trainer published."""


class Relay:
    """The newest publication this rank received (`tensors`, `version`, `sums`), the publications still arriving
    (`publications`, in the order announced), and the load of the relay into the engine."""

    def __init__(self, engine: LLMEngine, receiver: WeightReceiver | None, *, rank: int, verify: bool,
                 event: Callable[..., None]):
        self.engine, self.receiver, self.rank, self.verify, self.event = engine, receiver, rank, verify, event
        self.tensors: dict[str, torch.Tensor] = {}
        self.version = -1
        self.sums: dict[str, int] = {}                          # tensor name -> checksum (when verified)
        self.publications = InOrder("relay-receiver")          # publications arriving, in the order announced
        self.notices: dict[int, tuple[float, int]] = {}        # version -> (when announced, tokens decoded by then)

    def announce(self, version: int) -> None:
        """ReceiveWeights: join publication `version`'s broadcast on the relay's thread; the engine decodes on."""
        if self.receiver is None:
            raise RuntimeError(f"rank {self.rank} told to receive weights but it has no publication group")
        self.notices[version] = (time.perf_counter(), self.engine.num_tokens_decoded)
        self.publications.submit(version, self._receive, version)

    def take(self, wait: bool = False) -> None:
        """Fill the relay with the publications received (`wait`: after waiting for those still arriving)."""
        if not self.publications.pending:
            return
        peers = self.receiver.peers if self.receiver is not None else [0]
        done = (self.publications.wait_all(f"the publication of weights v{self.publications.pending[-1]} "
                                           f"(from rank(s) {peers})", on=peers, phase=Phase.PUBLISH)
                if wait else self.publications.take())
        for announced, (version, tensors, sums, seconds) in done:
            self.tensors, self.version, self.sums = tensors, version, sums
            t, tokens = self.notices.pop(announced)
            self.event("weights_received", version=version,
                       data={"seconds": seconds, "since_notice_s": time.perf_counter() - t,
                             "tokens_decoded": self.engine.num_tokens_decoded - tokens})

    def fill(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Fill the relay at once with `version` (what a received publication does; tests use it to stage weights)."""
        self.tensors, sums = self._relay_of(tensors)
        self.version = version
        if self.verify:
            self.sums = sums

    def load(self, version: int, keep_kv: bool = False) -> None:
        """LoadWeights: adopt the relay's weights (the newest published, at least `version`) in the engine; running
        sequences keep their KV with `keep_kv` (sched.decisions.LoadWeights), else they are recomputed."""
        if version > self.version:
            raise RuntimeError(f"rank {self.rank}: told to load version {version} but the relay holds "
                               f"{self.version}")
        running = self.engine.running_with_kv()
        self.engine.load_weights(self.tensors.items(), self.version, keep_kv=keep_kv)
        if self.verify:
            self.check_engine_weights()
        self.event("weights_loaded", version=self.version,
                   data={"running": running, "kept_kv": self.engine.running_with_kv()})

    def check_engine_weights(self) -> None:
        """The engine's tensors after a load equal the relay's (hence the trainer's) bit for bit, or the run stops
        naming the first tensor that differs."""
        params = self.engine.runner.model.state_dict()
        for name, want in self.sums.items():
            got = checksum(params[name])
            if got != want:
                raise WeightMismatchError(f"rank {self.rank}: engine tensor {name} differs from the published "
                                          f"version {self.version} after loading (checksum {got} != {want})")

    def close(self) -> None:
        """Take the publications still arriving, then stop the relay's thread."""
        self.take(wait=True)
        self.publications.close("the relay's thread", on=[0])

    def _receive(self, version: int) -> tuple[int, dict[str, torch.Tensor], dict[str, int], float]:
        """On the relay's thread: one publication, whole (its version, tensors, checksums, seconds)."""
        t0 = time.perf_counter()
        got: list = []
        peers = self.receiver.peers
        with waiting(f"the publication of weights v{version} (from rank(s) {peers})", on=peers, phase=Phase.PUBLISH,
                     step=version):
            v = self.receiver.receive(lambda tensors, _: got.extend(self._relay_of(tensors)))
        return v, got[0], got[1], time.perf_counter() - t0

    def _relay_of(self, tensors: Any) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """The received tensors themselves (views of buffers each publication allocates anew), on the CPU, and their
        checksums when verified: the receiver's, checked against the trainer's (else taken here)."""
        relay = {name: t.detach().to("cpu") for name, t in tensors}
        sums = {}
        if self.verify:
            known = self.receiver.hashes if self.receiver is not None else {}
            sums = {n: known[n] if n in known else checksum(t) for n, t in relay.items()}
        return relay, sums

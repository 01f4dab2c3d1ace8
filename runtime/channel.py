"""The control channel: picklable Python objects between ranks over a dedicated gloo process group.

torch.distributed is the transport (no RPC framework). Gloo receive handles cannot be polled, so each rank runs
one inbox thread that blocks in an any-source `recv` and drops what arrives into a `queue.Queue` per port; the
rank's loops read their port's queue with a deadline. Ports let one rank host two roles (the controller and a
worker, in colocated mode). A message is a 3-int64 header (source rank, payload bytes, port) followed by the
pickled payload as uint8.

Deadlines: every blocking `send` and `get` is a declared wait (runtime/watchdog.py) on the ranks it depends on: a
send on its destination (gloo hands a message over only once the peer's inbox thread receives it, so a send to a
frozen peer blocks), a get on the ranks named by the caller; the watchdog ends the process with a report naming
them when none makes progress for `cluster.timeout_s`. A get with an explicit `timeout` is a short poll that raises
ChannelTimeout instead.
"""
from __future__ import annotations

import pickle
import queue
import threading
from typing import Any, Sequence

import torch
import torch.distributed as dist

from runtime.watchdog import waiting

HEADER_TAG, PAYLOAD_TAG = 11, 12
_STOP = -1
CONTROLLER, WORKER = 0, 1  # ports


class ChannelTimeout(TimeoutError):
    pass


class Channel:
    def __init__(self, group: dist.ProcessGroup | None, rank: int):
        self.group = group
        self.rank = rank
        self.inboxes: dict[int, "queue.Queue[tuple[int, Any]]"] = {CONTROLLER: queue.Queue(), WORKER: queue.Queue()}
        self._send_lock = threading.Lock()
        self.bytes_sent = 0
        self.messages_sent = 0
        self._thread: threading.Thread | None = None
        if group is not None and dist.get_world_size(group) > 1:  # a world of one only posts to itself
            self._thread = threading.Thread(target=self._receive_loop, name=f"inbox-r{rank}", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------------------------------------- sending
    def send(self, obj: Any, dst: int, port: int = CONTROLLER) -> None:
        if dst == self.rank:  # same process (e.g. the trainer thread reporting to the controller)
            self.inboxes[port].put((self.rank, obj))
            return
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        what = "events" if isinstance(obj, list) else type(obj).__name__
        with self._send_lock, waiting(f"rank {dst} to take {what}", on=[dst]):
            dist.send(torch.tensor([self.rank, data.numel(), port], dtype=torch.int64), dst, group=self.group,
                      tag=HEADER_TAG)
            dist.send(data, dst, group=self.group, tag=PAYLOAD_TAG)
        self.bytes_sent += data.numel()
        self.messages_sent += 1

    def post(self, obj: Any, port: int = CONTROLLER) -> None:
        """Deliver to this rank's own inbox (from another thread of the same rank)."""
        self.inboxes[port].put((self.rank, obj))

    # ----------------------------------------------------------------------------------------------- receiving
    def _receive_loop(self) -> None:
        while True:
            header = torch.zeros(3, dtype=torch.int64)
            try:
                dist.recv(header, src=None, group=self.group, tag=HEADER_TAG)
            except Exception as e:  # process group torn down or timed out: tell the loops, then stop
                for q in self.inboxes.values():
                    q.put((-1, ("channel_error", repr(e))))
                return
            src, n, port = int(header[0]), int(header[1]), int(header[2])
            if n == _STOP:
                return
            buf = torch.empty(n, dtype=torch.uint8)
            dist.recv(buf, src=src, group=self.group, tag=PAYLOAD_TAG)
            # Unpickling can run code: this is safe only because every sender is a rank of this same job (the
            # control group is made by train.py over torchrun's own ranks). Never point it at untrusted peers.
            self.inboxes[port].put((src, pickle.loads(buf.numpy().tobytes())))

    def get(self, port: int = CONTROLLER, *, waiting_for: str = "a message", on: Sequence[int] = (),
            timeout: float | None = None) -> tuple[int, Any]:
        """Next (source rank, object). Without `timeout`: a wait on the ranks `on` under the watchdog's deadline;
        with it: ChannelTimeout after `timeout` seconds."""
        if timeout is None:
            with waiting(waiting_for, on):
                src, obj = self.inboxes[port].get()
        else:
            try:
                src, obj = self.inboxes[port].get(timeout=timeout)
            except queue.Empty:
                raise ChannelTimeout(f"rank {self.rank} waited {timeout:g}s for {waiting_for}") from None
        if src == -1 and isinstance(obj, tuple) and obj[0] == "channel_error":
            raise ConnectionError(f"rank {self.rank}: control channel failed: {obj[1]}")
        return src, obj

    def poll(self, port: int = CONTROLLER) -> list[tuple[int, Any]]:
        """Everything already delivered to `port`, without blocking."""
        out = []
        while True:
            try:
                src, obj = self.inboxes[port].get_nowait()
            except queue.Empty:
                return out
            if src == -1 and isinstance(obj, tuple) and obj[0] == "channel_error":
                raise ConnectionError(f"rank {self.rank}: control channel failed: {obj[1]}")
            out.append((src, obj))

    def close(self, stop_peer: int | None) -> None:
        """Stop the inbox thread of `stop_peer` (ranks stop each other in a ring after a barrier), then join ours."""
        if self.group is None:
            return
        if stop_peer is not None and stop_peer != self.rank:
            with self._send_lock, waiting(f"rank {stop_peer} to take the channel's stop", on=[stop_peer]):
                dist.send(torch.tensor([self.rank, _STOP, 0], dtype=torch.int64), stop_peer, group=self.group,
                          tag=HEADER_TAG)
        if self._thread is not None and stop_peer is not None and stop_peer != self.rank:
            self._thread.join(timeout=10)  # a world of one has no peer to stop it: the daemon thread just ends

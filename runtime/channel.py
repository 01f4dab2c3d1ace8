"""The control channel: picklable Python objects between ranks over a dedicated gloo process group.

torch.distributed is the transport (no RPC framework). Gloo receive handles cannot be polled, so each rank runs
one inbox thread that blocks in an any-source `recv` and drops what arrives into a `queue.Queue`; the rank's main
loop then reads that queue with a deadline. A message is a 2-int64 header (source rank, payload bytes) followed
by the pickled payload as uint8.

Deadlines: every `get` takes a timeout, and `ChannelTimeout` names who was being waited for, so a silent peer ends
the job with a message instead of hanging at a collective for the process group's default 30 minutes.
"""
from __future__ import annotations

import pickle
import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

HEADER_TAG, PAYLOAD_TAG = 11, 12
_STOP = -1


class ChannelTimeout(TimeoutError):
    pass


class Channel:
    def __init__(self, group: dist.ProcessGroup | None, rank: int, timeout_s: float = 300.0):
        self.group = group
        self.rank = rank
        self.timeout_s = timeout_s
        self.inbox: "queue.Queue[tuple[int, Any]]" = queue.Queue()
        self._send_lock = threading.Lock()
        self.bytes_sent = 0
        self.messages_sent = 0
        self._thread: threading.Thread | None = None
        if group is not None:
            self._thread = threading.Thread(target=self._receive_loop, name=f"inbox-r{rank}", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------------------------------------- sending
    def send(self, obj: Any, dst: int) -> None:
        if dst == self.rank:  # same process (e.g. the trainer thread reporting to the controller)
            self.inbox.put((self.rank, obj))
            return
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        with self._send_lock:
            dist.send(torch.tensor([self.rank, data.numel()], dtype=torch.int64), dst, group=self.group,
                      tag=HEADER_TAG)
            dist.send(data, dst, group=self.group, tag=PAYLOAD_TAG)
        self.bytes_sent += data.numel()
        self.messages_sent += 1

    def post(self, obj: Any) -> None:
        """Deliver to this rank's own inbox (from another thread of the same rank)."""
        self.inbox.put((self.rank, obj))

    # ----------------------------------------------------------------------------------------------- receiving
    def _receive_loop(self) -> None:
        while True:
            header = torch.zeros(2, dtype=torch.int64)
            try:
                dist.recv(header, src=None, group=self.group, tag=HEADER_TAG)
            except Exception as e:  # process group torn down or timed out: tell the main loop, then stop
                self.inbox.put((-1, ("channel_error", repr(e))))
                return
            src, n = int(header[0]), int(header[1])
            if n == _STOP:
                return
            buf = torch.empty(n, dtype=torch.uint8)
            dist.recv(buf, src=src, group=self.group, tag=PAYLOAD_TAG)
            self.inbox.put((src, pickle.loads(buf.numpy().tobytes())))

    def get(self, timeout: float | None = None, waiting_for: str = "a message") -> tuple[int, Any]:
        """Next (source rank, object); raises ChannelTimeout after `timeout` seconds (default: the channel's)."""
        timeout = self.timeout_s if timeout is None else timeout
        try:
            src, obj = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise ChannelTimeout(f"rank {self.rank} waited {timeout:.0f}s for {waiting_for}") from None
        if src == -1 and isinstance(obj, tuple) and obj[0] == "channel_error":
            raise ConnectionError(f"rank {self.rank}: control channel failed: {obj[1]}")
        return src, obj

    def poll(self) -> list[tuple[int, Any]]:
        """Everything already delivered, without blocking."""
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def close(self, stop_peer: int | None) -> None:
        """Stop the inbox thread of `stop_peer` (ranks stop each other in a ring after a barrier), then join ours."""
        if self.group is None:
            return
        if stop_peer is not None and stop_peer != self.rank:
            with self._send_lock:
                dist.send(torch.tensor([self.rank, _STOP], dtype=torch.int64), stop_peer, group=self.group,
                          tag=HEADER_TAG)
        if self._thread is not None:
            deadline = time.monotonic() + 10
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))

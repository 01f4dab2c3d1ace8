"""A migrated request's KV, moved between rollout ranks over torch.distributed instead of re-prefilled at the
destination (Laminar's repack, §5, moves long-tail trajectories between rollouts of one weight version;
StaleFlow's migration, §5.3, moves trajectories between instances; neither paper says how the KV travels, see
shared/research/seeds_laminar.md §1.5).

A transfer is a 7-int64 header (request id, weight version, layers, tokens, KV heads, head dim, dtype) on the CPU,
then the KV itself ([2, layers, tokens, KV heads, head dim]: engine/sequence.py's KVState) on the engine's device,
over the rollout ranks' own group (`Topology.kv_group`: gloo on CPU, NCCL on GPU for the tensor). A header of 0
tokens means "no KV" (the source holds none for that request any more): the destination re-prefills.

    KVSender(group)                the source's sending thread: `send` queues and returns, so the source's engine
                                   keeps decoding; transfers leave in the order they were queued
    KVReceiver(group, device)      the destination's receiving thread: `receive` queues and returns, so the
                                   destination's engine keeps decoding too; `take` hands over what has arrived,
                                   `wait_all` waits for the rest
    recv_kv(req_id, src, group)    one blocking receive (what the receiving thread runs)
    KeptKV(engine)                 the source's KV kept since a migrating Interrupt, by request id: its blocks stay
                                   held out of the engine's pool (LLMEngine.export) until it is popped or cleared

In the runtime (runtime/kv_migration.py, runtime/backend.py): a Migrate becomes an Interrupt carrying its
destination; the source exports the request with its KV, keeps the KV aside and tags the partial trajectory it hands
back with its rank. When the controller resubmits that request (to the destination, or wherever it goes), the backend
sends the source a `SendKV` right before the destination's `Start`, under one lock with publications' notices, so
every rollout rank sees transfers and publications in one global order (no rank waits in a broadcast for a rank
waiting in a receive). The destination queues the receive when it handles the `Start` and keeps decoding; the
request joins its engine when its KV is in (the worker looks at every loop turn, and waits for every KV still
coming before it handles any message other than a `Start` or a `SendKV`, so an interrupt, abort, weight load or
stop finds the request in the engine, as if it had been received at once). It is imported as cached when the KV's
weight version is the engine's (the next step is a decode), else re-prefilled (LLMEngine.import_request).

Deadlines (runtime/watchdog.py): each send is a declared wait on its destination (in the sender's thread), each
receive a declared wait on its source; a frozen or stuck peer ends the job with a report naming the request and the
rank, never a hang.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.engine import LLMEngine
from engine.sequence import KVState
from runtime.background import InOrder
from runtime.watchdog import progress, waiting

HEADER_TAG, KV_TAG = 21, 22
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def send_kv(kv: KVState | None, req_id: int, dst: int, group: dist.ProcessGroup | None) -> None:
    """Send request `req_id`'s KV (None: "no KV") to global rank `dst` (blocking, a declared wait on `dst`)."""
    if kv is not None and kv.data.dtype not in DTYPES:
        raise ValueError(f"request {req_id}: KV of dtype {kv.data.dtype} cannot be sent (one of {DTYPES})")
    shape = tuple(kv.data.shape[1:]) if kv is not None else (0, 0, 0, 0)
    header = torch.tensor([req_id, kv.version if kv is not None else -1, *shape,
                           DTYPES.index(kv.data.dtype) if kv is not None else 0], dtype=torch.int64)
    with waiting(f"rank {dst} to take the KV of request {req_id}", on=[dst]):
        dist.send(header, dst, group=group, tag=HEADER_TAG)
        if kv is not None:
            dist.send(kv.data.contiguous(), dst, group=group, tag=KV_TAG)
    progress(f"sent the KV of request {req_id} to rank {dst}")


def recv_kv(req_id: int, src: int, group: dist.ProcessGroup | None, device: torch.device) -> KVState | None:
    """Receive request `req_id`'s KV from global rank `src` onto `device` (blocking, a declared wait on `src`);
    None when the source had none to send."""
    header = torch.zeros(7, dtype=torch.int64)
    with waiting(f"the KV of request {req_id} from rank {src}", on=[src]):
        dist.recv(header, src, group=group, tag=HEADER_TAG)
        rid, version, layers, tokens, heads, dim, code = header.tolist()
        if rid != req_id:
            raise RuntimeError(f"KV transfer out of order: expected request {req_id} from rank {src}, got {rid}")
        if tokens == 0:
            return None
        data = torch.empty((2, layers, tokens, heads, dim), dtype=DTYPES[code], device=device)
        dist.recv(data, src, group=group, tag=KV_TAG)
    progress(f"received the KV of request {req_id} from rank {src}")
    return KVState(data, version)


class KVSender:
    """The source's sends, one at a time in queue order on a background thread (runtime/background.py, started at
    the first send). A failed send is raised at the next `send` or at `close`."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.jobs = InOrder("kv-sender")
        self.pending: dict[int, int] = {}   # req_id -> destination rank, of the transfers not yet taken

    def send(self, kv: KVState | None, req_id: int, dst: int) -> None:
        self._forget_sent()
        self.pending[req_id] = dst
        self.jobs.submit(req_id, send_kv, kv, req_id, dst, self.group)

    def close(self) -> None:
        """Wait until every queued transfer is taken (a declared wait on their destinations), stop the thread."""
        self._forget_sent()
        on = sorted(set(self.pending.values()))
        self.jobs.close(f"ranks {on} to take the KV of requests {sorted(self.pending)}", on=on)
        self.pending.clear()

    def _forget_sent(self) -> None:
        for req_id, _ in self.jobs.take():   # raises a failed send's error
            self.pending.pop(req_id, None)


class KVReceiver:
    """The destination's receives, one at a time in the order queued, on a background thread (runtime/background.py),
    so a migrated request's KV arrives while this rank's engine keeps decoding. Receives from one source are taken
    in the order that source sends them (the backend's SendKV order = the Starts' order). A failed receive is raised
    at the next `take`, `wait_all` or `close`."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group, self.device = group, device
        self.jobs = InOrder("kv-receiver")
        self.pending: dict[int, int] = {}   # req_id -> source rank, of the receives not yet handed over

    def receive(self, req_id: int, src: int) -> None:
        self.pending[req_id] = src
        self.jobs.submit(req_id, recv_kv, req_id, src, self.group, self.device)

    def take(self) -> list[tuple[int, KVState | None]]:
        """The receives completed since the last call, in order (request id, its KV or None for "no KV")."""
        return self._handed(self.jobs.take())

    def wait_all(self) -> list[tuple[int, KVState | None]]:
        """Everything still coming, after waiting for it (a declared wait on its sources)."""
        return self._handed(self.jobs.wait_all(*self._waiting()))

    def close(self) -> None:
        """Stop the thread once nothing is pending (what is still coming is received and dropped)."""
        self._handed(self.jobs.close(*self._waiting()))

    def _waiting(self) -> tuple[str, list[int]]:
        on = sorted(set(self.pending.values()))
        return f"the KV of requests {sorted(self.pending)} from rank(s) {on}", on

    def _handed(self, done: list) -> list[tuple[int, KVState | None]]:
        for req_id, _ in done:
            self.pending.pop(req_id, None)
        return done


class KeptKV:
    """KV kept by request id since a migrating Interrupt, within the engine's KV budget: the engine holds as many
    blocks out of its pool as the copy fills (LLMEngine.export), and gets them back when the copy leaves this map
    (`pop`: sent, dropped or resumed here; `clear`: void after a weight load or a failure)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.kv: dict[int, KVState] = {}

    def __setitem__(self, req_id: int, kv: KVState) -> None:
        self.kv[req_id] = kv

    def __contains__(self, req_id: int) -> bool:
        return req_id in self.kv

    def __len__(self) -> int:
        return len(self.kv)

    def pop(self, req_id: int, default: KVState | None = None) -> KVState | None:
        self.engine.release_kv(req_id)
        return self.kv.pop(req_id, default)

    def clear(self) -> None:
        for req_id in self.kv:
            self.engine.release_kv(req_id)
        self.kv.clear()

"""Publication routes side by side (`cluster.relay`): the train leader's broadcast to every rollout rank vs Laminar's
relay chain (App. C: the leader sends to the first relay only, each relay forwards to the next, pipelined bucket by
bucket), on one gloo world of 1 + R CPU processes, alternating.

    python bench/relay.py                          # 64 MiB of weights, 3 relays, 8 MiB buckets, 5 publications a mode
    python bench/relay.py --mib 16 --relays 2 --repeats 3

The weights are a stack of random fp32 Linear layers of `--mib` MiB in all, published by trainer/publish.py's
WeightPublisher to WeightReceivers (the runtime's own code; checksums with `--verify`) with `--bucket-mib` buckets. Per
publication: the trainer's stall (the leader's `publish` call: what the train step waits for when the publication
is not overlapped), the time until the last relay holds the whole version (from the leader's start to the latest
receiver's end, one machine's clock), and the bytes each process wrote to its sockets meanwhile (Linux
/proc/self/io `wchar`, every thread: gloo sends on its own), over the weights' bytes: the copies the leader sends,
which bound its stall wherever its link is the bottleneck (across nodes), whatever this machine's cores do. Last
line: broadcast over chain for the stall and the last relay's fill (medians), and the leader's copies per mode.

On this 2-core machine the R + 1 processes share two cores, so the copies a broadcast makes and the copies a chain
makes side by side compete for the same cores; read the time ratios with that in mind, and the leader's copies as the
mechanism's own measure (gloo's broadcast is a binomial tree: the root sends ceil(log2(R + 1)) copies; the chain's
leader sends one).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from runtime.ports import free_port  # noqa: E402

DEADLINE_S = 300   # for any one collective of the bench


def _model(mib: int) -> torch.nn.Module:
    width = 1024
    layers = max(1, (mib << 20) // (width * width * 4))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])


def _written() -> int:
    """Bytes this process has written (files and sockets, every thread), or -1 where /proc/self/io is missing
    (the copies then print as nan)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration, ValueError):
        return -1


def _rank(rank: int, world: int, port: int, out: str, mib: int, bucket_mib: int, repeats: int, verify: bool
          ) -> None:
    from trainer.publish import WeightPublisher, WeightReceiver
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a frozen or dead peer ends every rank's collective within the deadline; start_processes then ends the rest
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=DEADLINE_S))
    train, pub = dist.new_group([0]), dist.new_group(list(range(world)))
    chain = list(range(1, world))
    rows = []
    try:
        for rep in range(repeats):
            for mode in (("broadcast", "chain") if rep % 2 == 0 else ("chain", "broadcast")):
                route = chain if mode == "chain" else None
                dist.barrier()
                if rank == 0:
                    p = WeightPublisher(_model(mib), pub, train, bucket_bytes=bucket_mib << 20, verify=verify,
                                        chain=route)
                    w0, t0 = _written(), time.time()
                    p.publish(rep)
                    rows.append((mode, t0, time.time(), _written() - w0 if w0 >= 0 else math.nan, sum(p.sizes)))
                else:
                    rx = WeightReceiver(pub, src=0, chain=route)
                    w0 = _written()
                    rx.receive(lambda it, v: [None for _ in it])
                    rows.append((mode, 0.0, time.time(), _written() - w0 if w0 >= 0 else math.nan, 0))
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="weights to publish, MiB")
    ap.add_argument("--relays", type=int, default=3, help="rollout ranks (relays)")
    ap.add_argument("--bucket-mib", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="publications per mode (alternating)")
    ap.add_argument("--verify", action="store_true", help="per-tensor checksums on (the runtime's default); they "
                    "cost the leader the same either way and hide the route's share of the stall")
    a = ap.parse_args(argv)
    if a.relays < 1:
        ap.error("--relays must be at least 1")
    world = a.relays + 1
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, free_port(), out, a.mib, a.bucket_mib, a.repeats, a.verify),
                           nprocs=world, join=True, start_method="spawn")
        rows = []
        for r in range(world):
            with open(os.path.join(out, f"{r}.json")) as f:
                rows.append(json.load(f))
    stall: dict[str, list[float]] = {"broadcast": [], "chain": []}
    filled: dict[str, list[float]] = {"broadcast": [], "chain": []}
    copies: dict[str, list[list[float]]] = {"broadcast": [], "chain": []}   # per publication, per rank
    for i, (mode, t0, t1, _, size) in enumerate(rows[0]):
        stall[mode].append(t1 - t0)
        filled[mode].append(max(r[i][2] for r in rows[1:]) - t0)
        copies[mode].append([r[i][3] / size for r in rows])
    for mode in ("broadcast", "chain"):
        sent = [statistics.median(c[k] for c in copies[mode]) for k in range(world)]
        print(f"{mode:9s}  {a.mib} MiB to {a.relays} relays: trainer stall median "
              f"{statistics.median(stall[mode]) * 1e3:7.1f} ms, last relay filled "
              f"{statistics.median(filled[mode]) * 1e3:7.1f} ms; copies of the weights sent by the leader "
              f"{sent[0]:.2f}, by relays 1..{a.relays} {' / '.join(f'{x:.2f}' for x in sent[1:])}  "
              f"({len(stall[mode])} publications)")
    s = statistics.median(stall["broadcast"]) / statistics.median(stall["chain"])
    f = statistics.median(filled["broadcast"]) / statistics.median(filled["chain"])
    lead = {m: statistics.median(c[0] for c in copies[m]) for m in copies}
    print(f"broadcast / chain: trainer stall {s:.2f}x, last relay filled {f:.2f}x; leader's copies of the weights "
          f"sent {lead['broadcast']:.2f} / {lead['chain']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A free TCP port for a local job's rendezvous (the tests' torchrun and spawned worlds, bench/relay.py,
sim/validate.py's recorded pairs), picked where no outgoing connection can take it before the job binds it."""
from __future__ import annotations

import random
import socket


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def free_port(offsets: tuple[int, ...] = ()) -> int:
    """A port p below the ephemeral range, free now, with p + d free for each d of `offsets`. A port the kernel
    hands out for bind(0) comes from that range, as do the source ports of every outgoing connection (gloo opens
    many): between the pick and the job's own bind another connection could take it (EADDRINUSE, seen once in three
    suite runs). Below the range only another explicit bind can, and the picks are random."""
    rng, low = random.SystemRandom(), ephemeral_low()
    first = max(1024, low - 12000)
    for _ in range(200):
        port = rng.randrange(first, low - max(offsets, default=0))
        if all(_bindable(port + d) for d in (0, *offsets)):
            return port
    raise RuntimeError(f"no free port in [{first}, {low}) after 200 tries")

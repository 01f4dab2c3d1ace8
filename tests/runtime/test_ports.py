"""runtime/ports.py: a rendezvous port below the kernel's ephemeral range, free with its offsets."""
from __future__ import annotations

import socket

from runtime.ports import ephemeral_low, free_port


def test_a_picked_port_lies_below_the_ephemeral_range_and_binds_with_its_offsets():
    low = ephemeral_low()
    picks = {free_port((10,)) for _ in range(20)}
    assert len(picks) > 1   # random, not the kernel's next port
    for port in picks:
        assert 1024 <= port and port + 10 < low
        for p in (port, port + 10):
            with socket.socket() as s:
                s.bind(("", p))


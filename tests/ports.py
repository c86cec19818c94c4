"""A TCP port for a test's server (TCPStore, moto, a Ray head) that no other test or process takes first.

``bind(("127.0.0.1", 0))`` hands out a port from the kernel's ephemeral range (32768-60999 here) and
releases it at once; until the server binds it, any outgoing connection or ``bind(0)`` in another
process (a Ray worker, gloo's pair sockets, another xdist worker's test) may be given the same port,
and the server fails with EADDRINUSE. The ports here come from below the ephemeral range and above
Ray's default worker ports (10002-19999), from a block of their own for each pytest-xdist worker,
and are checked free before they are returned.
"""

from __future__ import annotations

import itertools
import os
import random
import socket

_LOW, _HIGH = 20000, 32000  # [_LOW, _HIGH): not ephemeral, not Ray's worker ports


def _block() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = (_HIGH - _LOW) // max(count, 1)
    return range(_LOW + index * size, _LOW + (index + 1) * size)


_order: list[int] = []
_next = itertools.count()


def free_port() -> int:
    """A port in this xdist worker's block, free when returned; a different one on each call."""
    if not _order:
        block = list(_block())
        random.Random(os.getpid()).shuffle(block)
        _order.extend(block)
    for _ in range(len(_order)):
        port = _order[next(_next) % len(_order)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_block()}")

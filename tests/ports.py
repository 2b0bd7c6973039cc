"""Loopback ports for the servers tests start.

`bind(("127.0.0.1", 0))`-and-close hands out a port nobody holds *now*; two calls may
return the same one (two servers of one test then race for it), and the port lies in
the kernel's ephemeral range, so an outgoing connection can take it before the server
binds, or while a test has the server down and restarts it on the same port. These are
chosen below that range, are never handed out twice by one test process, and each
pytest-xdist worker draws from a slice of its own.
"""

from __future__ import annotations

import os
import random
import socket

__all__ = ["free_port"]

# Above Ray's defaults: its worker ports (10002-19999), which a Ray node refuses to see
# any port it was given in, its client server (10001), dashboard (8265) and GCS (6379).
_LOWEST = 20000
_QUICK_START = range(28400, 28410)  # docs/examples/nemo_gym/config.yaml's fixed ports
_given: set[int] = set()


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _slice() -> range:
    low, high = _LOWEST, _ephemeral_floor()
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    width = (high - low) // max(count, 1)
    return range(low + index * width, low + (index + 1) * width)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that no socket holds, not handed out before by this process."""
    ports = _slice()
    for _ in range(2000):
        port = random.choice(ports)
        if port in _given or port in _QUICK_START:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port on {host} in {ports.start}-{ports.stop - 1}")

"""A flood of silent connections at a port: opened from a source address of their own at
RATE a second for SECONDS, never written to, the oldest closed (with a reset: no
TIME_WAIT left behind) once HELD are open. What a stranger on a cluster's network can do
to a placed worker's port without any key (`tests/test_nemo_gym_ray_placement.py`).

    python -m tests.link_flood HOST PORT SOURCE RATE SECONDS

It prints `flooding` once its first thousand connections are out, then, when it ends,
`opened N`. It runs as a process of its own, so the test's event loop is not the one
opening them.
"""

from __future__ import annotations

import socket
import struct
import sys
import time
from collections import deque

__all__ = ["flood"]

HELD = 1000  # open at once, at most (a process's default descriptor limit is 1024)
IP_BIND_ADDRESS_NO_PORT = 24  # Linux: the port is picked at connect, per destination
RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s


def flood(host: str, port: int, source: str, rate: float, seconds: float) -> int:
    """Open silent connections to `host:port` from `source` at `rate` a second for
    `seconds`; how many were opened."""
    held: deque[socket.socket] = deque()
    started = time.monotonic()
    opened = 0
    while (elapsed := time.monotonic() - started) < seconds:
        due = int(elapsed * rate) + 1
        while opened < due:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET_ON_CLOSE)
            sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            sock.setblocking(False)
            sock.bind((source, 0))
            sock.connect_ex((host, port))  # in progress; never written to
            held.append(sock)
            opened += 1
            if opened == 1000:
                print("flooding", flush=True)
            if len(held) > HELD:
                held.popleft().close()
        time.sleep(0.001)  # pacing the rate, not waiting for anything
    for sock in held:
        sock.close()
    return opened


def main() -> None:
    host, port, source, rate, seconds = sys.argv[1:6]
    print(f"opened {flood(host, int(port), source, float(rate), float(seconds))}", flush=True)


if __name__ == "__main__":
    main()

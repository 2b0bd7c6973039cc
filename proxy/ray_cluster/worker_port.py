"""A placed worker's listening socket, bound by whoever starts the worker on its node
(`worker_host.WorkerHost`, or the node's zygote, `node_zygote`): on gym-proxy's own node,
when it runs as gym-proxy's user, a Unix socket in gym-proxy's runtime directory (0700:
nobody else can reach it); elsewhere a TCP port on the node's own address."""

from __future__ import annotations

import os
import secrets
import socket
import stat

__all__ = ["bind_port", "private_directory", "SOCKET_PREFIX"]

BACKLOG = 4096  # as a local worker's socket (`worker.identity.WORKER_BACKLOG`)
UNIX_PATH_MAX = 100  # sun_path holds 108 bytes; a longer runtime directory: TCP
SOCKET_PREFIX = "placed-"  # never "w…sock": those are the local workers' (adoption)


def private_directory(path: str) -> bool:
    """Whether `path` is a directory of this user that no one else may enter (gym-proxy's
    runtime directory, as this process sees it): only then is a socket in it private."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.getuid()
        and stat.S_IMODE(info.st_mode) & 0o077 == 0
    )


def bind_port(host: str, unix_dir: str = "") -> tuple[socket.socket, str]:
    """A worker's listening socket: a Unix socket in `unix_dir` when it is given, private
    and short enough (and its path), else TCP on `host` (and "")."""
    if unix_dir and private_directory(unix_dir):
        path = os.path.join(unix_dir, f"{SOCKET_PREFIX}{secrets.token_hex(8)}.sock")
        if len(path.encode()) <= UNIX_PATH_MAX:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(path)
                sock.listen(BACKLOG)
                return sock, path
            except OSError:
                sock.close()
    return socket.create_server((host, 0), backlog=BACKLOG), ""

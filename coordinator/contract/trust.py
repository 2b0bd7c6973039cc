"""What gym-proxy believes of a file, a directory or a Unix socket's peer: only what its
own user made and no one else can change.

A runtime directory lives under a parent that may be shared (`/tmp`, mode 1777), where
another user can make a `gym-proxy-*` directory, a state file or a socket with the names
gym-proxy looks for. So a path is trusted only when it is owned by this process's uid,
is not writable by its group or others, and is of the expected type (looked at without
following a link); a peer on a Unix socket only when the kernel says it runs as this
uid (`SO_PEERCRED`), and its pid, when it claims one, only as the kernel gives it.
Each refusal is an `Untrusted` whose message is the one line to log.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass

__all__ = [
    "Untrusted",
    "Peer",
    "DIRECTORY",
    "FILE",
    "SOCKET",
    "check_owned",
    "private_directory",
    "peer_of",
    "own_peer",
]

_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Untrusted(Exception):
    """A path or a peer gym-proxy will not believe (the message names it and why)."""


@dataclass(frozen=True, slots=True)
class Peer:
    """The process at the other end of a Unix socket, as the kernel recorded it when the
    connection was made."""

    pid: int
    uid: int
    gid: int


# Write bits that let another user change a path: a directory's group too (its members
# could plant files in it). A file or a socket inside a private directory is out of
# everyone else's reach whatever its mode (a umask of 002 makes files group-writable),
# so only its world bit refuses a file, and nothing of its mode a socket: a socket's
# peer is checked instead.
DIRECTORY = stat.S_IWGRP | stat.S_IWOTH
FILE = stat.S_IWOTH
SOCKET = 0


def check_owned(info: os.stat_result, path: str, writable: int = DIRECTORY) -> None:
    """Untrusted unless `info` (of `path`) is this uid's and has none of the `writable`
    bits (DIRECTORY, FILE or SOCKET)."""
    uid = os.getuid()
    if info.st_uid != uid:
        raise Untrusted(f"{path} belongs to uid {info.st_uid}, not to this user (uid {uid})")
    if info.st_mode & writable:
        raise Untrusted(f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})")


def private_directory(path: str) -> os.stat_result:
    """The status of the directory at `path` (not followed if a link); Untrusted unless it
    is a directory this uid owns and no one else may write."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise Untrusted(f"{path}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise Untrusted(f"{path} is not a directory")
    check_owned(info, path)
    return info


def peer_of(sock: socket.socket) -> Peer:
    """Who is at the other end of the connected Unix socket `sock`."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    return Peer(*_CREDENTIALS.unpack(raw))


def own_peer(sock: socket.socket, what: str) -> Peer:
    """The peer of `sock`, Untrusted unless it runs as this uid (`what` names the socket
    in the message)."""
    try:
        peer = peer_of(sock)
    except OSError as exc:
        raise Untrusted(f"cannot tell who is at the other end of {what}: {exc.strerror}") from None
    if peer.uid != os.getuid():
        raise Untrusted(
            f"the process at the other end of {what} (pid {peer.pid}) runs as uid {peer.uid}, "
            f"not as this user (uid {os.getuid()})"
        )
    return peer

"""The private runtime directory of one gym-proxy instance (sockets live there).

Each instance makes `gym-proxy-XXXX/` (mode 0700) under the parent and holds an exclusive
`flock` on `instance.lock` inside it for its whole life. A directory whose lock can be
taken belongs to an instance that died without cleaning up (kill -9): it is removed when
the next instance starts under the same parent. The kernel drops the lock with the
process, so a recycled pid can never make a live instance look dead.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time

__all__ = ["RuntimeDir", "ensure_parent", "remove_stale", "longest_parent"]

log = logging.getLogger("gym_proxy")

PREFIX = "gym-proxy-"
LOCK_NAME = "instance.lock"
# A directory this young may belong to an instance still setting up its lock.
STALE_AFTER = 10.0


# Socket paths must fit sockaddr_un (108 bytes with the NUL): the parent, then
# "/gym-proxy-XXXXXXXX", then the longest socket name, "/w<slot>-<owner>.sock".
SOCKET_PATH_MAX = 107
_LONGEST_NAME = len("/gym-proxy-XXXXXXXX") + len("/w9999-") + 11 + len(".sock")


def longest_parent() -> int:
    """The longest parent directory path whose sockets still fit sockaddr_un."""
    return SOCKET_PATH_MAX - _LONGEST_NAME


def ensure_parent(parent: str) -> None:
    """Create `--runtime-dir` (mode 0700) if it does not exist; OSError if it cannot be,
    ValueError if it is too long for Unix socket paths."""
    if len(os.path.abspath(parent).encode()) > longest_parent():
        raise ValueError(
            f"is too long for Unix socket paths (at most {longest_parent()} bytes); "
            "pick a shorter directory"
        )
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{parent} is not writable")


def remove_stale(parent: str | None) -> list[str]:
    """Remove runtime directories of dead instances under `parent`; return their paths."""
    parent = parent or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not entry.is_dir(follow_symlinks=False) or info.st_uid != uid:
                continue
            if time.time() - info.st_mtime < STALE_AFTER:
                continue
            fd = os.open(os.path.join(entry.path, LOCK_NAME), os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # no lock file: not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live instance holds it
        finally:
            os.close(fd)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


class RuntimeDir:
    """This instance's runtime directory, locked while it lives."""

    def __init__(self, parent: str | None) -> None:
        self.path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
        os.chmod(self.path, 0o700)
        self._lock_fd = os.open(
            os.path.join(self.path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600
        )
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def remove(self) -> None:
        """Delete the directory and release the lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

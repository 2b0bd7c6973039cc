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
import hashlib
import hmac
import logging
import os
import shutil
import socket
import tempfile
import time

from gym_proxy.coordinator.contract.state_files import (
    UnreadableDocument,
    read_document,
    replace_document,
)
from gym_proxy.coordinator.contract.trust import Untrusted, private_directory

__all__ = [
    "RuntimeDir",
    "open_runtime_dir",
    "RuntimeDirBusy",
    "RuntimeDirLocked",
    "ensure_parent",
    "remove_stale",
    "remove_abandoned",
    "longest_parent",
    "adoptable_name",
    "secret_fingerprint",
    "live_worker_in",
    "live_workers_in",
    "waiting_workers",
    "read_identity",
    "trusted_directory",
]

log = logging.getLogger("gym_proxy")

PREFIX = "gym-proxy-"
LOCK_NAME = "instance.lock"
IDENTITY_NAME = "instance.json"  # which instance, signing with which secret (adoption)
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
        except OSError:
            continue
        if not _abandoned(entry.path) or live_worker_in(entry.path):
            continue  # alive, or an orphaned worker waits there for its instance to return
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def remove_abandoned(path: str) -> bool:
    """Remove the runtime directory at `path` if the instance that made it is dead (its
    lock can be taken) and no worker listens in it, at any age; whether it did. What
    outlives a gym-proxy killed with -9 (its Ray placement driver) cleans up with this."""
    if not trusted_directory(path) or not _abandoned(path) or live_worker_in(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.exists(path)


def waiting_workers(parent: str | None) -> dict[str, str]:
    """Runtime directories under `parent` of dead instances whose workers still wait to
    be adopted (`--orphan-grace`): path -> the instance name their identity file gives."""
    waiting: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent or tempfile.gettempdir()):
            if not entry.name.startswith(PREFIX) or not trusted_directory(entry.path):
                continue
            identity = read_identity(entry.path)
            if identity is not None and _abandoned(entry.path) and live_worker_in(entry.path):
                waiting[entry.path] = str(identity.get("instance"))
    return waiting


def read_identity(path: str) -> dict[str, object] | None:
    """The identity file of the runtime directory at `path`, None without one to believe."""
    with contextlib.suppress(UnreadableDocument):
        return _identity(path)
    return None


def _identity(path: str) -> dict[str, object] | None:
    """The identity file of the runtime directory at `path`: None when there is none,
    UnreadableDocument when it cannot be believed."""
    where = os.path.join(path, IDENTITY_NAME)
    found = read_document(where)
    if found is None or (isinstance(found, dict) and isinstance(found.get("instance"), str)):
        return found
    raise UnreadableDocument(f"{where} is not an identity file")


def trusted_directory(path: str) -> bool:
    """Whether `path` is a directory this user owns and no one else may write (another
    user's `gym-proxy-*` under a shared parent is not looked into)."""
    try:
        private_directory(path)
    except Untrusted:
        return False
    return True


def _abandoned(path: str) -> bool:
    """Whether the instance that made the directory is dead: its lock can be taken (one
    without a lock file is not ours to judge)."""
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # a live instance holds it
    finally:
        os.close(fd)


def live_worker_in(path: str) -> bool:
    """Whether a worker still listens on one of the directory's worker sockets."""
    return live_workers_in(path, stop_at=1) > 0


def live_workers_in(path: str, stop_at: int = 0) -> int:
    """How many workers still listen on the directory's worker sockets (counting stops
    at `stop_at` when it is set)."""
    live = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            if entry.name.startswith("w") and entry.name.endswith(".sock"):
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(entry.path)
                    live += 1
                    if live == stop_at:
                        break
                except OSError:
                    continue
                finally:
                    probe.close()
    return live


def adoptable_name(instance: str, address: str) -> str:
    """The runtime directory name of an instance whose workers outlive it (`--orphan-grace`):
    the same for the same instance name and listen address, so the same command started
    again finds it; as long as a random one (socket paths must fit)."""
    digest = hashlib.sha256(f"{instance}\0{address}".encode()).hexdigest()
    return PREFIX + digest[:8]


def secret_fingerprint(secret: bytes, instance: str) -> str:
    """What the identity file records of the secret: enough to tell another secret, no
    more (an HMAC of the instance name, not the secret)."""
    return hmac.new(secret, f"gym-proxy runtime {instance}".encode(), "sha256").hexdigest()


class RuntimeDirBusy(Exception):
    """The runtime directory this instance would take cannot be its own."""


class RuntimeDirLocked(RuntimeDirBusy):
    """Another live gym-proxy holds it (one being taken over lets it go soon)."""


class RuntimeDir:
    """This instance's runtime directory, locked while it lives. With a `name` (an
    instance whose workers outlive it), the directory a dead instance of the same name
    left is taken over, workers and all (`found` then holds its identity file; when the
    directory had none to believe, `unidentified` says why)."""

    def __init__(self, parent: str | None, name: str | None = None) -> None:
        self.found: dict[str, object] | None = None
        self.unidentified: str | None = None
        if name is None:
            self.path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
            os.chmod(self.path, 0o700)
            self._lock_fd = os.open(
                os.path.join(self.path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600
            )
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            return
        self.path = os.path.join(parent or tempfile.gettempdir(), name)
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            try:  # one another user could have written into is not one to adopt from
                private_directory(self.path)
            except Untrusted as exc:
                raise RuntimeDirBusy(str(exc)) from None
            os.chmod(self.path, 0o700)
        self._lock_fd = os.open(
            os.path.join(self.path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600
        )
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise RuntimeDirLocked(
                f"another gym-proxy of this instance runs with {self.path} (it holds the lock)"
            ) from None
        try:
            self.found = _identity(self.path)
        except UnreadableDocument as exc:
            self.unidentified = str(exc)
        else:
            if self.found is None:
                self.unidentified = f"{self.join(IDENTITY_NAME)} is missing"

    def write_identity(self, identity: dict[str, object]) -> None:
        """Record which instance this is (read by the one that may adopt its workers)."""
        replace_document(self.join(IDENTITY_NAME), identity)

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def release(self) -> None:
        """Let go of the directory without removing it (the workers in it go on, with a
        successor): from now on it is not this instance's to remove."""
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1

    def remove(self) -> None:
        """Delete the directory and release the lock (nothing, once released)."""
        if self._lock_fd < 0:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()


def open_runtime_dir(
    parent: str | None, instance: str, address: str, fingerprint: str | None
) -> RuntimeDir:
    """This instance's runtime directory (dead instances' left under `parent` removed
    first). With a `fingerprint` (`--orphan-grace`: its workers outlive it), the one the
    same command's earlier instance used, found by `instance` and the public `address`:
    if it died, its workers wait there to be adopted, which only an instance signing
    with the same secret may do (RuntimeDirBusy otherwise, the directory left as it
    was). Warns of other instances' workers waiting under `parent`."""
    for stale in remove_stale(parent):
        log.info("removed the runtime directory of a dead instance: %s", stale)
    if fingerprint is None:
        runtime = RuntimeDir(parent)
    else:
        runtime = RuntimeDir(parent, adoptable_name(instance, address))
        if runtime.found is not None and runtime.found.get("secret") != fingerprint:
            runtime.release()
            raise RuntimeDirBusy(
                f"cannot adopt the workers a dead instance left in {runtime.path}: they serve "
                "tokens signed with another secret (start with the same --secret-file)"
            )
        runtime.write_identity({"instance": instance, "secret": fingerprint})
    for path, waiting in waiting_workers(parent).items():
        if path != runtime.path:  # another instance's, or this one's at another address
            log.warning(
                "the workers of a dead gym-proxy (instance %r) wait in %s; this one is %r at "
                "%s: it does not adopt them (start that command again; they stop when their "
                "--orphan-grace ends)",
                waiting,
                path,
                instance,
                address,
            )
    return runtime

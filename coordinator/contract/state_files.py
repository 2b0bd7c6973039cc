"""Small JSON files a gym-proxy keeps in its runtime directory for its successor.

The identity, the fleet's intent and the restore note are each one small document that a
proxy writes while it runs and a proxy adopting its workers reads back. A write replaces
the file at once (a temporary file of a fresh random name beside it, made with
`O_EXCL`, then `os.replace`), so a proxy killed in the middle leaves the old document or
the new one, never half of either, and a link planted where a temporary file would go
is never written through. No fsync: these outlive a crashed process, not a crashed
machine (whose workers are gone too).

A read believes only a regular file this user owns and others may not write, of at
most MAX_SIZE bytes, opened without following a link and without blocking (a FIFO in
its place would otherwise hold the start for ever); anything else is refused in one line
(`UnreadableDocument`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import tempfile
from typing import Any

import orjson

from gym_proxy.coordinator.contract.trust import FILE, Untrusted, check_owned

__all__ = [
    "MAX_SIZE",
    "UnreadableDocument",
    "replace_document",
    "read_document",
    "load_document",
]

MAX_SIZE = 16 << 20  # bytes: far above any state file (the largest, an alias table)


class UnreadableDocument(Exception):
    """A state file that is there but cannot be believed (the message says why)."""


def replace_document(path: str | os.PathLike[str], document: Any) -> None:
    """Write `document` as JSON at `path`, replacing what was there at once."""
    directory, name = os.path.split(os.fspath(path))
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory or None)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(orjson.dumps(document))
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def read_document(path: str | os.PathLike[str]) -> Any | None:
    """The JSON document at `path`; None when there is no file; UnreadableDocument when
    the file is not one to believe (see the module docstring) or not JSON."""
    where = os.fspath(path)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnreadableDocument(f"{where} is a symbolic link") from None
        raise UnreadableDocument(f"{where}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableDocument(f"{where} is not a regular file")
        try:
            check_owned(info, where, FILE)
        except Untrusted as exc:
            raise UnreadableDocument(str(exc)) from None
        if info.st_size > MAX_SIZE:
            raise UnreadableDocument(f"{where} is {info.st_size} bytes, over {MAX_SIZE}")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(MAX_SIZE + 1)
    except OSError as exc:
        raise UnreadableDocument(f"{where}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SIZE:
        raise UnreadableDocument(f"{where} is over {MAX_SIZE} bytes")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise UnreadableDocument(f"{where} is not JSON ({exc})") from None


def load_document(
    path: str | os.PathLike[str], log: logging.Logger | None = None, unreadable: str = ""
) -> Any | None:
    """The JSON document at `path`; None when there is none, or when it cannot be
    believed (then, given `log`, one warning line: why, and `unreadable`, what follows)."""
    try:
        return read_document(path)
    except UnreadableDocument as exc:
        if log is not None:
            log.warning("%s: %s", exc, unreadable)
        return None

"""Small JSON files a gym-proxy keeps in its runtime directory for its successor.

The identity, the fleet's intent and the restore note are each one small document that a
proxy writes while it runs and a proxy adopting its workers reads back. A write replaces
the file at once (a temporary file beside it, then `os.replace`), so a proxy killed in the
middle leaves the old document or the new one, never half of either. No fsync: these
outlive a crashed process, not a crashed machine (whose workers are gone too).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import orjson

__all__ = ["replace_document", "load_document"]


def replace_document(path: str | os.PathLike[str], document: Any) -> None:
    """Write `document` as JSON at `path`, replacing what was there at once."""
    temp = f"{os.fspath(path)}.tmp"
    with open(temp, "wb") as out:
        out.write(orjson.dumps(document))
    os.replace(temp, path)


def load_document(
    path: str | os.PathLike[str], log: logging.Logger | None = None, unreadable: str = ""
) -> Any | None:
    """The JSON document at `path`; None when there is none, or when it cannot be read or
    parsed (then, given `log`, one warning line: the path, the error, `unreadable`)."""
    try:
        with open(path, "rb") as document:
            return orjson.loads(document.read())
    except FileNotFoundError:
        return None
    except (OSError, orjson.JSONDecodeError) as exc:
        if log is not None:
            log.warning("%s unreadable (%s): %s", os.fspath(path), exc, unreadable)
        return None

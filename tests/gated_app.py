"""The test app (tests/apps.py) behind an import gate, to act while gym-proxy starts.

With GYM_TEST_IMPORT_GATE naming a directory, importing this module creates `importing`
there and waits (up to a minute) until `go` exists: the proxy, which imports APP to
check it before its signal handlers are in place, is held at that point until the test
lets it go. Workers import it after `go` exists and pass at once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

GATE_ENV = "GYM_TEST_IMPORT_GATE"


def _wait_at_gate() -> None:
    directory = os.environ.get(GATE_ENV)
    if not directory:
        return
    Path(directory, "importing").touch()
    deadline = time.monotonic() + 60
    while not Path(directory, "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


_wait_at_gate()

from tests.apps import create_app  # noqa: E402

__all__ = ["create_app", "GATE_ENV"]

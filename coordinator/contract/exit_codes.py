"""The exit codes a worker process reports to the supervisor that started it."""

from __future__ import annotations

from typing import Final

__all__ = ["BOOT_ERROR", "LOST_COORDINATOR"]

# The app cannot be built or started: respawning would fail the same way, so the
# supervisor stops the whole server instead.
BOOT_ERROR: Final = 3
# The coordinator channel ended (the proxy is gone or stopping): respawned if wanted.
LOST_COORDINATOR: Final = 4

"""What goes wrong with the server's Ray cluster, as the user hears it: one line, and the
exit status gym-proxy stops with."""

from __future__ import annotations

__all__ = ["RAY_ERROR", "RayError"]

RAY_ERROR = 5  # gym-proxy's exit status: the Ray cluster could not be started, joined or used


class RayError(RuntimeError):
    """The Ray cluster could not be started, joined or used: one line for the user."""

"""What goes wrong with the server's Ray cluster, as the user hears it: one line (gym-proxy
stops with exit status `coordinator.contract.exit_codes.RAY_ERROR`)."""

from __future__ import annotations

__all__ = ["RayError"]


class RayError(RuntimeError):
    """The Ray cluster could not be started, joined or used: one line for the user."""

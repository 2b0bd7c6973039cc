"""The ID rules every floor checks: session and owner IDs, checkpoint IDs, rollout IDs.

One pattern per kind of ID, written once: the proxy's tokens, the control plane's calls,
the checkpoint files and the configuration all check against these.
"""

from __future__ import annotations

import re
from typing import TypeGuard

__all__ = [
    "ID_PATTERN",
    "CHECKPOINT_ID",
    "ROLLOUT_ID",
    "MAX_ROLLOUT_ID",
    "is_valid_id",
    "is_checkpoint_id",
    "is_rollout_id",
]

# Session IDs and owner IDs (what a token names): URL-safe base64 characters.
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
# NeMo Gym's checkpoint IDs (and gym-proxy's --name, which names a checkpoint's directory).
CHECKPOINT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
# NeMo Gym's ROLLOUT_ID_PATTERN; the control plane also caps the length.
ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
MAX_ROLLOUT_ID = 512


def is_valid_id(value: str) -> bool:
    """True if `value` may be used as a session ID or an owner ID."""
    return ID_PATTERN.match(value) is not None


def is_checkpoint_id(value: str) -> bool:
    """True if `value` is a checkpoint ID (1-128 of A-Z a-z 0-9 . _ -, not starting . _ -)."""
    return CHECKPOINT_ID.match(value) is not None


def is_rollout_id(value: object) -> TypeGuard[str]:
    """True if `value` is a string NeMo Gym accepts as a rollout ID."""
    return isinstance(value, str) and ROLLOUT_ID.match(value) is not None

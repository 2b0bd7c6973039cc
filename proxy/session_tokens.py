"""Signed session tokens: `v1.<session_id>.<owner or ->.<mac>`.

`mac` is HMAC-SHA256 over `v1.<session_id>.<owner or ->` with the server's secret,
base64url without padding (43 characters). Session IDs and owners use the base64url
alphabet, 1..64 characters, so a token never needs quoting in a cookie or a header.
The codec is pure: no I/O, no clock.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

__all__ = ["TokenError", "SessionIdentity", "TokenCodec", "new_session_id", "new_owner_id"]

_ID = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
_MAC_LEN = 43
NO_OWNER = "-"


class TokenError(ValueError):
    """The token is malformed or its MAC does not verify."""


@dataclass(frozen=True, slots=True)
class SessionIdentity:
    """What a verified token says: the session ID and the owner it names (or None)."""

    session_id: str
    owner: str | None


def new_session_id() -> str:
    """A fresh random session ID (128 bits)."""
    return secrets.token_urlsafe(16)


def new_owner_id() -> str:
    """A fresh random owner ID for one worker incarnation (64 bits)."""
    return secrets.token_urlsafe(8)


def is_valid_id(value: str) -> bool:
    """True if `value` may be used as a session ID or an owner ID."""
    return _ID.match(value) is not None


class TokenCodec:
    """Signs and verifies session tokens with one secret.

    Verified tokens are remembered (bounded) so the hot path pays the HMAC once per
    token rather than once per request.
    """

    def __init__(self, secret: bytes, cache_size: int = 65536) -> None:
        if not secret:
            raise ValueError("the session secret must not be empty")
        self._secret = secret
        self._cache: dict[str, SessionIdentity] = {}
        self._cache_size = cache_size

    def _mac(self, body: str) -> str:
        digest = hmac.new(self._secret, body.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def sign(self, session_id: str, owner: str | None) -> str:
        """Return the token for `session_id` owned by `owner` (None: no owner)."""
        if not is_valid_id(session_id) or (owner is not None and not is_valid_id(owner)):
            raise TokenError("session ID and owner must be 1-64 base64url characters")
        body = f"v1.{session_id}.{owner or NO_OWNER}"
        return f"{body}.{self._mac(body)}"

    def verify(self, token: str) -> SessionIdentity:
        """Return the identity a token names; raise TokenError if it does not verify."""
        known = self._cache.get(token)
        if known is not None:
            return known
        parts = token.split(".")
        if len(parts) != 4 or parts[0] != "v1":
            raise TokenError("session token is not of the form v1.<session>.<owner>.<mac>")
        _, session_id, owner, mac = parts
        if not is_valid_id(session_id) or not (owner == NO_OWNER or is_valid_id(owner)):
            raise TokenError("session token has a malformed session ID or owner")
        if len(mac) != _MAC_LEN:
            raise TokenError("session token has a malformed signature")
        expected = self._mac(f"v1.{session_id}.{owner}")
        if not hmac.compare_digest(expected, mac):
            raise TokenError("session token signature does not verify")
        identity = SessionIdentity(session_id, None if owner == NO_OWNER else owner)
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[token] = identity
        return identity

"""Signed session tokens that name the instance which minted them.

A token is `v2.<instance>.<session_id>.<owner or ->.<mac>`:

- `instance` is this gym-proxy's tag: the first 66 bits of HMAC-SHA256(secret,
  "gym-proxy instance\\0" + its name), base64url (11 characters). Two instances tell
  their tokens apart even when they share one secret (their names differ), and an
  instance with another secret never sees its tag;
- `mac` is HMAC-SHA256 over everything before it, with the secret, base64url without
  padding (43 characters), so neither the instance, the session nor the owner can be
  changed.

Cookies travel between the servers of a NeMo Gym stack (an agent calls the resources
server with the cookies its seed returned, and answers with them), so a token is only
this instance's business when its tag is this instance's: `TokenCodec.read` returns
None for anything else, and the caller passes it on untouched. A token with this tag
that does not verify is damaged or forged: `TokenError`.

Session IDs and owners use the base64url alphabet, 1..64 characters, so a token never
needs quoting in a cookie or a header. The codec is pure: no I/O, no clock.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Final

from gym_proxy.coordinator.contract.ids import is_valid_id

__all__ = [
    "TokenError",
    "SessionIdentity",
    "TokenCodec",
    "instance_tag",
    "new_session_id",
    "new_owner_id",
]

_MAC_LEN: Final = 43
_TAG_LEN: Final = 11
NO_OWNER: Final = "-"


class TokenError(ValueError):
    """The token is this instance's but malformed, or its MAC does not verify."""


@dataclass(frozen=True, slots=True)
class SessionIdentity:
    """What a verified token says: the session ID and the owner it names (or None)."""

    session_id: str
    owner: str | None


def _random_id(nbytes: int) -> str:
    # IDs are typed on command lines (`gym-proxy-ctl move --session ID`), where one that
    # begins with '-' reads as an option; redrawing those costs 1/64 of the values.
    while True:
        value = secrets.token_urlsafe(nbytes)
        if not value.startswith("-"):
            return value


def new_session_id() -> str:
    """A fresh random session ID (128 bits), never beginning with '-'."""
    return _random_id(16)


def new_owner_id() -> str:
    """A fresh random owner ID for one worker incarnation (64 bits), never beginning with '-'."""
    return _random_id(8)


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def instance_tag(secret: bytes, instance: str) -> str:
    """The tag tokens of instance `instance` carry under `secret`."""
    digest = hmac.new(secret, b"gym-proxy instance\0" + instance.encode(), hashlib.sha256)
    return _b64(digest.digest())[:_TAG_LEN]


class TokenCodec:
    """Signs and reads session tokens of one instance (name and secret).

    Verified tokens are remembered (bounded) so the hot path pays the HMAC once per
    token rather than once per request.
    """

    def __init__(self, secret: bytes, instance: str = "", cache_size: int = 65536) -> None:
        if not secret:
            raise ValueError("the session secret must not be empty")
        self._secret = secret
        self.tag = instance_tag(secret, instance)
        self.prefix = f"v2.{self.tag}."  # every token of this instance starts so
        self._cache: dict[str, SessionIdentity] = {}
        # The same, by the bytes a request carried: no decoding and no second hash of
        # the text on the hot path (~500 instructions a request).
        self._wire_cache: dict[bytes, SessionIdentity] = {}
        self._cache_size = cache_size

    def _mac(self, body: str) -> str:
        return _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())

    def sign(self, session_id: str, owner: str | None) -> str:
        """Return the token for `session_id` owned by `owner` (None: no owner)."""
        if not is_valid_id(session_id) or (owner is not None and not is_valid_id(owner)):
            raise TokenError("session ID and owner must be 1-64 base64url characters")
        body = f"{self.prefix}{session_id}.{owner or NO_OWNER}"
        return f"{body}.{self._mac(body)}"

    def read_bytes(self, token: bytes) -> SessionIdentity | None:
        """`read` for a token as it came off the wire: one that is not ASCII is not this
        instance's unless it carries this instance's prefix, and then it is damaged."""
        known = self._wire_cache.get(token)
        if known is not None:
            return known
        try:
            text = token.decode("ascii")
        except UnicodeDecodeError:
            if token.startswith(self.prefix.encode()):
                raise TokenError("session token is not ASCII") from None
            return None
        identity = self.read(text)
        if identity is not None:
            if len(self._wire_cache) >= self._cache_size:
                self._wire_cache.clear()
            self._wire_cache[token] = identity
        return identity

    def read(self, token: str) -> SessionIdentity | None:
        """The identity this instance's token names; None for a token that is not this
        instance's (another instance's or the app's: pass it on); TokenError for one that
        is, but does not verify."""
        known = self._cache.get(token)
        if known is not None:
            return known
        if not token.startswith(self.prefix):
            return None
        identity = self._verify(token)
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[token] = identity
        return identity

    def _verify(self, token: str) -> SessionIdentity:
        parts = token.split(".")
        if len(parts) != 5:
            raise TokenError(
                "session token is not of the form v2.<instance>.<session>.<owner>.<mac>"
            )
        session_id, owner, mac = parts[2:]
        if not is_valid_id(session_id) or not (owner == NO_OWNER or is_valid_id(owner)):
            raise TokenError("session token has a malformed session ID or owner")
        if len(mac) != _MAC_LEN:
            raise TokenError("session token has a malformed signature")
        if not hmac.compare_digest(self._mac(token[: -_MAC_LEN - 1]), mac):
            raise TokenError("session token signature does not verify")
        return SessionIdentity(session_id, None if owner == NO_OWNER else owner)

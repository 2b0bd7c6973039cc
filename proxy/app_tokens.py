"""The session an app's own `X-NeMo-Gym-Session-Token` names (pure; no I/O).

NeMo Gym servers mint MCP session tokens with itsdangerous' `URLSafeSerializer`:
`[.]<base64url(json payload)>.<signature>`, the leading dot meaning the payload is
zlib-compressed. The payload is the app's session ID, or `{"sid": ..., "tools": [...]}`.
The proxy cannot verify the signature (the secret is the app's) and does not need to:
it only reads which session the token names to pick the worker; the app verifies it.
A forged token can therefore only reach the worker that holds the session it names, or
none, and the proxy never remembers a session it learned from a token.
"""

from __future__ import annotations

import base64
import binascii
import zlib

import orjson

from proxy.session_tokens import is_valid_id

__all__ = ["app_token_session"]

_MAX_PAYLOAD = 64 * 1024  # a decompressed payload larger than this is not a session token


def app_token_session(token: bytes) -> str | None:
    """The session ID in an itsdangerous token, or None when it does not look like one."""
    payload, dot, signature = token.rpartition(b".")
    if not dot or not payload or not signature:
        return None
    compressed = payload.startswith(b".")
    if compressed:
        payload = payload[1:]
    try:
        raw = base64.urlsafe_b64decode(payload + b"=" * (-len(payload) % 4))
        if compressed:
            inflater = zlib.decompressobj()
            raw = inflater.decompress(raw, _MAX_PAYLOAD)
            if inflater.unconsumed_tail:
                return None  # a bomb, not a token
        claims = orjson.loads(raw)
    except (binascii.Error, ValueError, zlib.error):
        return None
    session_id = claims.get("sid") if isinstance(claims, dict) else claims
    if isinstance(session_id, str) and is_valid_id(session_id):
        return session_id
    return None

"""Which session an app's own IDs name: NeMo Gym's Starlette session cookie and its
MCP session tokens (pure; no I/O). Read by the proxy to route and by the workers to track.

**The session cookie.** NeMo Gym servers keep `{"session_id": <uuid4>}` in Starlette's
SessionMiddleware cookie: `base64(json).<timestamp>.<signature>` (itsdangerous'
TimestampSigner). Cookies travel between the servers of a NeMo Gym stack (an agent
answers with the resources server's and the model's cookies too), so the app's own cookie
is read by its name when known (NeMo Gym names it `<Class>___<instance>`); without a name,
the first Starlette session cookie is taken.

**The MCP token.** NeMo Gym servers mint `X-NeMo-Gym-Session-Token`s with itsdangerous'
`URLSafeSerializer`: `[.]<base64url(json payload)>.<signature>`, the leading dot meaning
the payload is zlib-compressed. The payload is the app's session ID, or `{"sid": ...,
"tools": [...]}`.

Neither signature is checked here (the secret is the app's, and the app verifies): a
forged one can only reach the worker that holds the session it names, or none, and the
proxy never remembers a session it learned from a token.
"""

from __future__ import annotations

import base64
import binascii
import zlib
from collections.abc import Iterable

import orjson

from gym_proxy.coordinator.contract.ids import is_valid_id

__all__ = ["SESSION_KEY", "session_in_cookie_value", "session_in_headers", "app_token_session"]

SESSION_KEY = "session_id"  # NeMo Gym's SESSION_ID_KEY
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


def session_in_cookie_value(value: bytes) -> str | None:
    """The `session_id` in one Starlette session cookie value, or None."""
    data, dot, rest = value.partition(b".")
    if not dot or rest.count(b".") != 1 or len(data) > 8192:
        return None
    try:
        payload = orjson.loads(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError):
        return None
    session_id = payload.get(SESSION_KEY) if isinstance(payload, dict) else None
    return session_id if isinstance(session_id, str) and session_id else None


def _cookies(header: bytes, set_cookie: bool) -> Iterable[tuple[bytes, bytes]]:
    if set_cookie:  # "name=value; Path=/; ..."
        name, _, value = header.split(b";", 1)[0].partition(b"=")
        yield name.strip(), value.strip().strip(b'"')
        return
    for pair in header.split(b";"):  # "a=1; b=2"
        name, _, value = pair.partition(b"=")
        yield name.strip(), value.strip().strip(b'"')


def session_in_headers(
    headers: Iterable[tuple[bytes, bytes]], set_cookie: bool, cookie: bytes | None = None
) -> str | None:
    """The app session named by a Starlette cookie among `Set-Cookie` (response) or
    `Cookie` (request) headers: the cookie named `cookie`, or the first one that parses."""
    wanted = b"set-cookie" if set_cookie else b"cookie"
    for name, value in headers:
        if name.lower() == wanted:
            for cookie_name, cookie_value in _cookies(value, set_cookie):
                if cookie is not None and cookie_name != cookie:
                    continue
                session_id = session_in_cookie_value(cookie_value)
                if session_id is not None:
                    return session_id
    return None

"""HTTP/1.1 bytes the data path writes and the header rules it applies (no I/O).

Every error the proxy itself answers is built by `error_response`, with its status and
`Retry-After` from the one table in `coordinator.contract.errors`.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Final

from gym_proxy.coordinator.contract import headers as names
from gym_proxy.coordinator.contract.errors import RETRY_AFTER, error_body, status_of

__all__ = [
    "HOP_BY_HOP",
    "CONTINUE_100",
    "error_response",
    "cookie_values",
    "set_cookie_headers",
    "refresh_cookie_header",
    "reason_phrase",
    "chunk",
    "connection_listed",
    "HeaderKinds",
    "MASKED_LENGTHS",
]

# Headers that describe one connection, not the message (RFC 9110 7.6.1).
HOP_BY_HOP: Final[frozenset[bytes]] = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-authenticate",
        b"proxy-authorization",
    }
)
# Identity header lines the proxy adds to a routed request (`name: ` before the value).
SESSION_ID_LINE: Final = names.SESSION_ID + b": "
SESSION_TOKEN_LINE: Final = names.SESSION_TOKEN + b": "
SESSION_NEW_LINE: Final = names.SESSION_NEW + b": 1\r\n"
EPISODE_KEY_LINE: Final = names.EPISODE_KEY + b": "
APP_SESSION_CLAIM_LINE: Final = names.APP_SESSION_CLAIM + b": "
CONTINUE_100 = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK: Final = b"0\r\n\r\n"

_REASONS: Final = {status.value: status.phrase.encode() for status in HTTPStatus}


def reason_phrase(status: int) -> bytes:
    """The standard reason phrase for `status` (empty for unknown codes)."""
    return _REASONS.get(status, b"")


def error_response(code: str, detail: str, *, close: bool, head_only: bool = False) -> bytes:
    """A complete JSON error response. `close` adds `Connection: close`."""
    status = status_of(code)
    body = error_body(code, detail)
    lines = [
        b"HTTP/1.1 %d %s\r\n" % (status, reason_phrase(status)),
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"cache-control: no-store\r\n",
    ]
    if code in RETRY_AFTER:
        lines.append(b"retry-after: 1\r\n")
    if close:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    if not head_only:
        lines.append(body)
    return b"".join(lines)


def cookie_values(cookie_header: bytes, name: bytes) -> list[bytes]:
    """Every value of the cookie `name` in a Cookie header (a client may send it twice)."""
    needle = name + b"="
    values: list[bytes] = []
    start = 0
    while True:
        at = cookie_header.find(needle, start)
        if at < 0:
            return values
        if at == 0 or cookie_header[at - 1] in b"; \t":
            begin = at + len(needle)
            end = cookie_header.find(b";", begin)
            value = cookie_header[begin:] if end < 0 else cookie_header[begin:end]
            values.append(value.strip().strip(b'"'))
        start = at + 1


def set_cookie_headers(name: bytes, token: bytes) -> bytes:
    """Header lines that hand the client its new session token in cookie `name`.

    Like HAProxy's `cookie insert indirect nocache`: the response is marked so no shared
    cache stores the cookie. The token also travels as a header for MCP clients.
    """
    return (
        b"set-cookie: " + name + b"=" + token + b"; Path=/; HttpOnly; SameSite=Lax\r\n"
        b'cache-control: no-cache="Set-Cookie"\r\n' + names.APP_TOKEN + b": " + token + b"\r\n"
    )


def refresh_cookie_header(name: bytes, token: bytes) -> bytes:
    """The same session cookie again (its value never changes: tokens are for life)."""
    return (
        b"set-cookie: " + name + b"=" + token + b"; Path=/; HttpOnly; SameSite=Lax\r\n"
        b'cache-control: no-cache="Set-Cookie"\r\n'
    )


def connection_listed(value: bytes) -> set[bytes]:
    """Header names a Connection header declares hop-by-hop (beyond the usual options)."""
    names = {token.strip().lower() for token in value.split(b",")}
    names.difference_update((b"keep-alive", b"close", b"upgrade", b""))
    return names


def chunk(data: bytes | memoryview) -> list[bytes | memoryview]:
    """`data` framed as one chunk of a chunked body, as buffers for writelines."""
    return [b"%x\r\n" % len(data), data, b"\r\n"]


# Header names of at most this many bytes can be told apart by their length alone.
MASKED_LENGTHS: Final = 62


class HeaderKinds:
    """What the proxy does with a header, by its name in any case: `kind(name)`.

    Most names (date, server, content-type, accept, user-agent) are of no length the
    proxy acts on: one bit test says so. The others are compared with the few names of
    their length as written lowercase and Title-Case (a compare is a memcmp, compiled),
    and only a name in some other case is lowered: lowering and a dict lookup cost ~800
    instructions a header, most of a small request's head."""

    __slots__ = ("mask", "by_length")

    def __init__(self, kinds: dict[bytes, int]) -> None:
        self.mask = 0
        self.by_length: list[list[tuple[bytes, bytes, int]]] = [[] for _ in range(MASKED_LENGTHS)]
        for name, kind in kinds.items():
            assert len(name) < MASKED_LENGTHS and name == name.lower(), name
            self.mask |= 1 << len(name)
            title = b"-".join(word.capitalize() for word in name.split(b"-"))
            self.by_length[len(name)].append((name, title, kind))

    def kind(self, name: bytes, default: int) -> int:
        """The kind of the header `name`, `default` for one the proxy does not act on."""
        size = len(name)
        if size >= MASKED_LENGTHS or not self.mask >> size & 1:
            return default
        candidates = self.by_length[size]
        for lower, title, kind in candidates:
            if name == lower or name == title:
                return kind
        first = name[0] | 0x20  # lowercase, for a letter (a name's first byte is a token's)
        lowered = b""
        for lower, _title, kind in candidates:
            if lower[0] == first:
                if not lowered:
                    lowered = name.lower()
                if lowered == lower:
                    return kind
        return default

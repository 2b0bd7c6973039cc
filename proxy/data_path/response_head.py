"""The response head a client sees, computed from what llhttp parsed (pure; no I/O).

Hop-by-hop headers of the worker's response are dropped (and the ones its `Connection`
names); the framing toward the client is the proxy's own: the worker's `Content-Length`
when it gave one, else chunked for an HTTP/1.1 client (or the end of the connection
for an HTTP/1.0 one). A 101 keeps `Upgrade` and says `Connection: upgrade`: the
connection becomes a tunnel. Headers only a worker may send to the proxy
(`x-ng-app-session`, `x-ng-app-session-end`) are taken out and returned.
"""

from __future__ import annotations

from typing import Final

from librt.strings import BytesWriter

from gym_proxy.coordinator.contract import headers as names
from gym_proxy.proxy.data_path import http_wire as wire

__all__ = ["ResponseHead", "rewrite_response_head", "NO_BODY_STATUS"]

NO_BODY_STATUS: Final = frozenset({204, 304})
# Final, as every name below read per header: the compiled data path (setup.py) inlines
# an int and keeps an object in a C static instead of looking it up in the module's dict.
_STATUS_LINES: Final = {
    status: b"HTTP/1.1 %d %s\r\n" % (status, wire.reason_phrase(status))
    for status in range(100, 600)
}
_PASS: Final = 0
_LENGTH: Final = 1
_CHUNKED: Final = 2
_CONNECTION: Final = 3
_DROP: Final = 4
_UPGRADE: Final = 5
_APP_SESSION: Final = 6
_APP_END: Final = 7
_KINDS: Final = {
    **dict.fromkeys(wire.HOP_BY_HOP, _DROP),
    b"content-length": _LENGTH,
    b"transfer-encoding": _CHUNKED,
    b"connection": _CONNECTION,
    b"upgrade": _UPGRADE,
    names.APP_SESSION: _APP_SESSION,
    names.APP_SESSION_END: _APP_END,
}
_HEADER_KINDS: Final = wire.HeaderKinds(_KINDS)


class ResponseHead:
    """The head to write, and the framing the body then follows. (A plain class, not a
    dataclass: mypyc compiles its __init__, where a dataclass's runs as Python.)"""

    __slots__ = (
        "data", "chunked", "until_eof", "close", "tunnel", "app_session", "app_session_end"
    )  # fmt: skip

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.chunked = False  # the proxy frames the body as chunks toward the client
        self.until_eof = False  # the worker's body ends where its connection ends
        self.close = False  # the client connection closes after this response
        self.tunnel = False  # a 101: after the head, bytes pass through both ways
        self.app_session: bytes | None = None  # a worker announced a session it holds
        self.app_session_end: bytes | None = None  # ... or that one ended


def rewrite_response_head(
    status: int,
    headers: list[tuple[bytes, bytes]],
    *,
    http10: bool,
    head_request: bool,
    close: bool,
    extra: bytes = b"",
    dropped: set[bytes] | None = None,
) -> ResponseHead:
    """The client's head for a worker's response. `close`: the proxy closes after it
    whatever the worker says; `extra`: header lines the proxy adds (its cookie);
    `dropped`: header names not forwarded (what the worker's `Connection` lists: the
    head is built again without them once a pass has found any). Written into a
    BytesWriter, as the request head is (proxy.data_path.request_head)."""
    out = BytesWriter()
    out.write(
        _STATUS_LINES.get(status) or b"HTTP/1.1 %d %s\r\n" % (status, wire.reason_phrase(status))
    )
    head = ResponseHead(b"")
    length_known = upstream_chunked = False
    listed: set[bytes] | None = None
    upgrade: bytes | None = None
    kinds = _HEADER_KINDS
    for name, value in headers:
        kind = kinds.kind(name, _PASS)
        if kind == _PASS or kind == _LENGTH:
            length_known = length_known or kind == _LENGTH
            # The framing stays whatever the Connection header lists.
            if dropped is None or kind == _LENGTH or name.lower() not in dropped:
                out.write(name)
                out.write(b": ")
                out.write(value)
                out.write(b"\r\n")
        elif kind == _CHUNKED:
            upstream_chunked = True
        elif kind == _CONNECTION:
            listed = wire.connection_listed(value)
        elif kind == _UPGRADE:
            upgrade = value
        elif kind == _APP_SESSION:
            head.app_session = value
        elif kind == _APP_END:
            head.app_session_end = value
    if listed and dropped is None:
        # Rare (a Connection header naming other headers): built again without them.
        return rewrite_response_head(
            status,
            headers,
            http10=http10,
            head_request=head_request,
            close=close,
            extra=extra,
            dropped=listed,
        )
    if extra:
        out.write(extra)
    if status == 101:
        head.tunnel = True
        if upgrade is not None:
            out.write(b"upgrade: ")
            out.write(upgrade)
            out.write(b"\r\n")
        out.write(b"connection: upgrade\r\n\r\n")
        head.data = out.getvalue()
        return head
    if not (head_request or status in NO_BODY_STATUS) and not length_known:
        head.until_eof = not upstream_chunked
        if http10:
            close = True  # an HTTP/1.0 client reads to the end of the stream
        else:
            out.write(b"transfer-encoding: chunked\r\n")
            head.chunked = True
    if close:
        out.write(b"connection: close\r\n")
    elif http10:
        out.write(b"connection: keep-alive\r\n")
    out.write(b"\r\n")
    head.close = close
    head.data = out.getvalue()
    return head

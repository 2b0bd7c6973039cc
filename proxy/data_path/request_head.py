"""The request head a worker sees, computed from what llhttp parsed (pure; no I/O).

The framing of the forwarded request is always the proxy's own: `content-length` with
the length llhttp framed the body by, `transfer-encoding: chunked` when llhttp de-chunked
it, or nothing for a request without a body. No client `Content-Length` or
`Transfer-Encoding` header is ever passed through, and a `Connection` list cannot remove
the framing or `Host`; so the worker parses exactly the one request the proxy parsed,
whatever the client's head says (no request smuggling through the pool).

Headers the proxy reads for routing (cookie, session token, owner hint) are returned to
the caller; identity headers a client sent are dropped, since only the proxy sets them.
An `X-NeMo-Gym-Session-Token` is this instance's (it starts with the instance's token
prefix, `proxy.data_path.session_tokens`; consumed here) or not (NeMo Gym's MCP tokens, another
gym-proxy's token), which passes through unchanged.
"""

from __future__ import annotations

from typing import Final

from librt.strings import BytesWriter

from gym_proxy.coordinator.contract import headers as names
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.proxy.data_path import http_wire as wire
from gym_proxy.proxy.data_path.session_tokens import TokenError

__all__ = ["RequestHead", "rewrite_request_head", "PROTECTED"]

# Headers a Connection list may name without effect: framing and Host are the proxy's.
PROTECTED: Final = frozenset({b"content-length", b"transfer-encoding", b"host"})

# Final, as every name below read per header: the compiled data path (setup.py) inlines
# an int and keeps an object in a C static instead of looking it up in the module's dict.
_PASS: Final = 0
_COOKIE: Final = 1
_TOKEN: Final = 2
_OWNER: Final = 3
_DROP: Final = 4
_TE: Final = 5
_CL: Final = 6
_EXPECT: Final = 7
_CONNECTION: Final = 8
_HOST: Final = 9
_UPGRADE: Final = 10
_KINDS: Final = {
    b"cookie": _COOKIE,
    names.APP_TOKEN: _TOKEN,
    names.SESSION_OWNER: _OWNER,
    b"transfer-encoding": _TE,
    b"content-length": _CL,
    b"expect": _EXPECT,
    b"connection": _CONNECTION,
    b"host": _HOST,
    b"upgrade": _UPGRADE,
    **{
        name: _DROP
        for name in wire.HOP_BY_HOP | names.IDENTITY_HEADERS
        if name not in (b"transfer-encoding", b"connection", b"upgrade")
    },
}
_HEADER_KINDS: Final = wire.HeaderKinds(_KINDS)


class RequestHead:
    """The forwarded head so far (request line and header lines, no framing, no final
    CRLF, in `out`) and what the router needs from the client's head. (A plain class,
    not a dataclass: mypyc compiles its __init__, where a dataclass's runs as Python.)"""

    __slots__ = (
        "out", "line_end", "token", "app_token", "cookie", "owner_hint", "content_length",
        "chunked", "expect_continue",
    )  # fmt: skip

    def __init__(self, out: BytesWriter) -> None:
        self.out = out
        self.line_end = len(out)  # where the request line ends in `out`
        self.token: bytes | None = None  # this instance's token from the header
        self.app_token: bytes | None = None  # the first other token in that header (the app's)
        self.cookie: bytes | None = None
        self.owner_hint: bytes | None = None
        # The Content-Length as the client wrote it, llhttp checked (digits only, one of
        # them), with no leading zero: forwarded as it is (int() and "%d" cost ~1.3k).
        self.content_length: bytes | None = None
        self.chunked = False
        self.expect_continue = False

    def add_line(self, start: bytes, value: bytes) -> None:
        """Add a header line: `start` (its name and ": ") and `value`."""
        out = self.out
        out.write(start)
        out.write(value)
        out.write(b"\r\n")

    def set_target(self, method: bytes, target: bytes) -> None:
        """Forward the request to `target` instead of the URL the client sent."""
        out = BytesWriter()
        _request_line(out, method, target)
        line_end = len(out)
        out.write(self.out.getvalue()[self.line_end :])
        self.out = out
        self.line_end = line_end


def _request_line(out: BytesWriter, method: bytes, target: bytes) -> None:
    out.write(method)
    out.write(b" ")
    out.write(target)
    out.write(b" HTTP/1.1\r\n")


def rewrite_request_head(
    method: bytes,
    url: bytes,
    version: str,
    headers: list[tuple[bytes, bytes]],
    upgrade: bool = False,
    token_prefix: bytes = b"v2.",
    dropped: set[bytes] | None = None,
) -> RequestHead:
    """The head to forward for a request llhttp accepted; raise GymError otherwise
    (TokenError for two different tokens of this instance in the token header).
    `upgrade`: llhttp saw a protocol switch asked for (WebSocket); `Upgrade` then
    passes, with `Connection: upgrade`, and is dropped otherwise (hop-by-hop).
    `token_prefix`: how this instance's tokens start. `dropped`: header names not
    forwarded (what the head's `Connection` lists: the head is built again without them
    once a pass has found any; they are still read for routing).

    llhttp already refuses what makes framing ambiguous (Content-Length with
    Transfer-Encoding, two Content-Lengths, a non-final `chunked`, bare LF, obs-fold);
    this refuses what it lets through but the proxy will not forward.

    The head is written into a BytesWriter (mypyc's librt): a write compiled is a copy
    into its buffer, where a list of parts joined cost ~100 instructions a part.
    """
    if version not in ("1.1", "1.0"):
        raise GymError("http_version_not_supported", f"HTTP/{version} is not supported")
    out = BytesWriter()
    _request_line(out, method, url)
    head = RequestHead(out)
    listed: set[bytes] | None = None
    codings: list[bytes] = []
    host_seen = False
    kinds = _HEADER_KINDS
    for name, value in headers:
        kind = kinds.kind(name, _PASS)
        forward = False
        if kind == _PASS:
            forward = True
        elif kind == _COOKIE:
            head.cookie = value if head.cookie is None else head.cookie + b"; " + value
            forward = True
        elif kind == _TOKEN:
            if value.startswith(token_prefix):
                if head.token is not None and head.token != value:
                    # Nothing tells which one the client meant (proxy.data_path.routing, "Copies").
                    raise TokenError(
                        "two X-NeMo-Gym-Session-Token headers carry different tokens of "
                        "this instance"
                    )
                head.token = value
            else:
                if head.app_token is None:
                    head.app_token = value  # the first routes; every one reaches the app
                forward = True
        elif kind == _OWNER:
            head.owner_hint = value
            forward = True
        elif kind == _CL:
            if len(value) > 1 and value[0] == 48:  # leading zeros: the worker gets none
                value = b"%d" % int(value)
            head.content_length = value
        elif kind == _TE:
            codings += (c.strip().lower() for c in value.split(b","))
        elif kind == _EXPECT:
            head.expect_continue = value.lower() == b"100-continue" and version != "1.0"
        elif kind == _CONNECTION:
            names = wire.connection_listed(value)
            listed = names if listed is None else listed | names
        elif kind == _UPGRADE:
            forward = upgrade
        elif kind == _HOST:
            if host_seen:
                raise GymError("bad_request", "more than one Host header")
            host_seen = True
            forward = True
        if forward and (dropped is None or name.lower() not in dropped):
            out.write(name)
            out.write(b": ")
            out.write(value)
            out.write(b"\r\n")
    if codings:
        if version == "1.0":
            # RFC 9112 6.1: Transfer-Encoding in HTTP/1.0 means the framing is faulty.
            raise GymError("bad_request", "Transfer-Encoding in an HTTP/1.0 request")
        if codings != [b"chunked"]:
            raise GymError(
                "unsupported_transfer_coding", "only Transfer-Encoding: chunked is accepted"
            )
        head.chunked = True
        head.content_length = None
    if listed and dropped is None:
        listed -= PROTECTED
        if upgrade:
            listed.discard(b"upgrade")
        if listed:
            # Rare (a Connection header naming other headers): built again without them.
            return rewrite_request_head(
                method, url, version, headers, upgrade, token_prefix, listed
            )
    if not host_seen:  # HTTP/1.0 clients may omit it; HTTP/1.1 to the worker needs it
        out.write(b"host: gym-proxy\r\n")
    if upgrade:
        out.write(b"connection: upgrade\r\n")
    return head

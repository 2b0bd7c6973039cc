"""The data path's shortcuts for a cheaper request (issue 40) give exactly what the long
way gives: the request-line version, the header-length filter, and large writes that
go out unjoined."""

from __future__ import annotations

import asyncio

import pytest

from gym_proxy.proxy.data_path import http_wire as wire
from gym_proxy.proxy.data_path import outbox
from gym_proxy.proxy.data_path.client_connection import _request_line_version
from gym_proxy.proxy.data_path.outbox import JOIN_AT_MOST, Outbox
from gym_proxy.proxy.data_path.request_head import rewrite_request_head
from gym_proxy.proxy.data_path.response_head import rewrite_response_head

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    ("chunk", "version"),
    [
        (b"GET / HTTP/1.1\r\nhost: a\r\n\r\n", "1.1"),
        (b"POST /x?y=1 HTTP/1.0\r\n\r\n", "1.0"),
        (b"GET / HTTP/1.1\nhost: a\r\n\r\n", ""),  # a bare LF: the parser is asked
        (b"\r\nGET / HTTP/1.1\r\n\r\n", ""),  # not a request line first
        (b"GET  / HTTP/1.1\r\n\r\n", ""),  # not where one space each puts it
        (b"GET / HTTP/2.0\r\n\r\n", ""),
        (b"GET / HTTP/1.1\r", ""),  # the line has not ended in this read
        (b"GET / HTTP/1.", ""),
        (b"", ""),
    ],
)
def test_the_request_line_version_is_read_only_when_it_is_certain(chunk, version):
    method, _, rest = chunk.partition(b" ")
    url = rest.lstrip(b" ").partition(b" ")[0] if b" " in rest else b"/"
    method = method.lstrip(b"\r\n") or b"GET"
    assert _request_line_version(bytearray(chunk), 0, method, url) == version
    # Where the part starts in the read.
    assert _request_line_version(bytearray(b"xx" + chunk), 2, method, url) == version


def test_headers_of_no_masked_length_pass_and_those_of_one_are_acted_on():
    head = rewrite_request_head(
        b"GET",
        b"/",
        "1.1",
        [(b"Host", b"a"), (b"X-Long-" + b"n" * 70, b"v"), (b"Keep-Alive", b"5"), (b"Date", b"d")],
    )
    forwarded = head.out.getvalue().lower()
    assert b"keep-alive" not in forwarded  # hop-by-hop, whatever its case
    assert b"x-long-" in forwarded and b"date: d" in forwarded
    response = rewrite_response_head(
        200,
        [(b"Content-Length", b"2"), (b"TRANSFER-ENCODING", b"chunked"), (b"Server", b"s")],
        http10=False,
        head_request=False,
        close=False,
    )
    assert b"transfer-encoding" not in response.data.lower()
    assert b"Content-Length: 2" in response.data and not response.chunked


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        (b"content-length", 1),
        (b"Content-Length", 1),
        (b"CONTENT-length", 1),  # neither lowercase nor Title-Case: lowered
        (b"content-lengtH", 1),
        (b"content-lengths", 0),  # a length no name has
        (b"Content-Lenhtg", 0),  # a length some name has
        (b"x-a", 3),
        (b"X-A", 3),
        (b"y-a", 0),
        (b"-x-a"[1:], 3),
    ],
)
def test_header_kinds_match_a_name_in_any_case_and_nothing_else(name, kind):
    kinds = wire.HeaderKinds({b"content-length": 1, b"content-lengtx": 2, b"x-a": 3})
    assert kinds.kind(name, 0) == kind


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[bytes]]] = []

    def write(self, data) -> None:
        self.calls.append(("write", [bytes(data)]))

    def writelines(self, list_of_data) -> None:
        self.calls.append(("writelines", [bytes(d) for d in list_of_data]))


@pytest.mark.parametrize("body_size", [100, JOIN_AT_MOST + 1])
def test_one_read_sends_one_write_joined_only_when_small(body_size):
    transport = _Transport()
    box = Outbox(transport)
    body = b"x" * body_size
    outbox.hold()
    try:
        box.write(b"HEAD\r\n\r\n")
        box.write(body)
    finally:
        outbox.release()
    assert len(transport.calls) == 1
    kind, buffers = transport.calls[0]
    assert b"".join(buffers) == b"HEAD\r\n\r\n" + body
    assert kind == ("write" if body_size <= JOIN_AT_MOST else "writelines")
    assert box.queued == 0


def test_a_connection_list_drops_the_headers_it_names_but_they_still_route():
    head = rewrite_request_head(
        b"GET",
        b"/a",
        "1.1",
        [
            (b"X-A", b"1"),
            (b"Cookie", b"c=1"),
            (b"Connection", b"x-a, Cookie, host"),
            (b"Host", b"h"),
        ],
    )
    forwarded = head.out.getvalue()
    assert forwarded == b"GET /a HTTP/1.1\r\nHost: h\r\n"  # Host is the proxy's to keep
    assert head.cookie == b"c=1"  # read for routing before the line was dropped
    response = rewrite_response_head(
        200,
        [(b"X-B", b"2"), (b"Content-Length", b"0"), (b"Connection", b"x-b, content-length")],
        http10=False,
        head_request=False,
        close=False,
    )
    assert response.data == b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"  # framing kept


def test_a_new_target_replaces_only_the_request_line():
    head = rewrite_request_head(b"POST", b"/ng-rollout/k/run", "1.1", [(b"Host", b"h")])
    head.set_target(b"POST", b"/run")
    head.add_line(b"x-a: ", b"1")
    assert head.out.getvalue() == b"POST /run HTTP/1.1\r\nHost: h\r\nx-a: 1\r\n"

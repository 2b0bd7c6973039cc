"""Identity comes only from a token the proxy verified, driven in process
(`proxy.data_path.routing`, "Identity"): an app's own token or cookie, which a client writes
and the proxy cannot verify, picks a worker at most and never carries a gym-proxy session;
every copy of this instance's token must verify; a cookie value that is not this instance's
token, ASCII or not, is passed on untouched."""

from __future__ import annotations

import base64
import zlib

import orjson
import pytest

from tests.data_path_rig import Rig

pytestmark = pytest.mark.fast

TOKEN = b"x-nemo-gym-session-token"
SESSION_ID = b"x-ng-session-id"
CLAIM = b"x-ng-app-session-claim"
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def request(*headers: tuple[bytes, bytes], path: bytes = b"/increment_counter") -> bytes:
    lines = b"".join(b"%s: %s\r\n" % header for header in headers)
    return b"POST %s HTTP/1.1\r\nhost: t\r\n%scontent-length: 2\r\n\r\n{}" % (path, lines)


def forged_tokens(session_id: str) -> dict[str, bytes]:
    """Unsigned app tokens naming `session_id`, in every shape NeMo Gym's MCP tokens take."""

    def b64(raw: bytes) -> bytes:
        return base64.urlsafe_b64encode(raw).rstrip(b"=")

    return {
        "json-string": b64(orjson.dumps(session_id)) + b".AAAA",
        "sid-claims": b64(orjson.dumps({"sid": session_id, "tools": None})) + b".AAAA",
        "compressed": b"." + b64(zlib.compress(orjson.dumps(session_id))) + b".AAAA",
    }


def starlette_cookie(session_id: str, name: bytes = b"session") -> bytes:
    """A Starlette-shaped session cookie naming `session_id`, with no valid signature."""
    payload = base64.b64encode(orjson.dumps({"session_id": session_id}))
    return name + b"=" + payload + b".x.y"


async def routed(rig: Rig, data: bytes) -> dict[bytes, bytes]:
    """Send one request and play the worker: the identity headers the worker was sent."""
    client = rig.client()
    client.send(data)
    upstream = await rig.upstream()
    headers = upstream.requests()[-1][2]  # a pooled connection carries earlier ones too
    upstream.send(OK)
    assert [status for status, _, _ in client.responses()] == [200]
    return headers


@pytest.mark.parametrize("shape", ["json-string", "sid-claims", "compressed"])
async def test_a_forged_app_token_never_reaches_a_placed_gym_proxy_session(shape):
    """The victim's session was moved to worker 1 (the session table places it there):
    an unsigned app token naming its ID routes as new work and carries no session."""
    rig = Rig(workers=2)
    rig.router.sessions["victim"] = "owner1"
    headers = await routed(rig, request((TOKEN, forged_tokens("victim")[shape])))
    assert SESSION_ID not in headers and CLAIM not in headers
    assert headers[TOKEN] == forged_tokens("victim")[shape]  # the app's, passed on
    assert rig.router.foreign_tokens == 1


async def test_a_forged_app_cookie_never_reaches_a_placed_gym_proxy_session():
    """A Starlette-shaped cookie naming the victim's moved session: a new session."""
    rig = Rig(workers=2)
    rig.router.app_cookie = b"session"
    rig.router.sessions["victim"] = "owner1"
    rig.router.app_sessions["somebody"] = "owner0"  # app sessions exist: rule 3 is looked at
    headers = await routed(rig, request((b"cookie", starlette_cookie("victim"))))
    assert headers[SESSION_ID] != b"victim" and headers[b"x-ng-session-new"] == b"1"
    assert CLAIM not in headers


async def test_an_announced_app_session_routes_by_its_claim_and_carries_no_session():
    """An app session a worker announced: its token or cookie picks that worker, and the
    worker is told only what the client claims (never a gym-proxy session)."""
    rig = Rig(workers=2)
    rig.router.app_cookie = b"session"
    rig.router.app_sessions["app-1"] = "owner1"
    for header in (
        (TOKEN, forged_tokens("app-1")["sid-claims"]),
        (b"cookie", starlette_cookie("app-1")),
    ):
        headers = await routed(rig, request(header))
        assert headers[CLAIM] == b"app-1"
        assert SESSION_ID not in headers and b"x-ng-session-token" not in headers
    assert [w.served for w in rig.router._live] == [0, 2]


async def test_a_gym_proxy_session_id_is_not_an_app_session_and_back():
    """The tables never cross: a verified token naming an ID of the app session table is
    routed by its own owner, and the app's token naming a gym-proxy session by nothing."""
    rig = Rig(workers=2)
    rig.router.app_sessions["shared"] = "owner1"
    rig.router.sessions["placed"] = "owner1"
    token = rig.codec.sign("shared", "owner0").encode()
    headers = await routed(rig, request((TOKEN, token)))
    assert headers[SESSION_ID] == b"shared" and rig.router._live[0].served == 1
    headers = await routed(rig, request((TOKEN, forged_tokens("placed")["json-string"])))
    assert SESSION_ID not in headers


async def test_a_client_copy_of_the_claim_header_is_removed():
    rig = Rig(workers=1)
    headers = await routed(rig, request((CLAIM, b"victim")))
    assert CLAIM not in headers


@pytest.mark.parametrize(
    "cookie",
    [
        b"gym_proxy=v1.\xe2\x98\x83.x.y",
        b"ng_session=caf\xc3\xa9",
        b"gym_proxy=caf\xc3\xa9; ng_session=v1.\xff",
    ],
    ids=["v1-shape", "another-cookie", "both"],
)
async def test_a_non_ascii_cookie_that_is_not_this_instances_token_is_passed_on(cookie):
    rig = Rig(workers=1)
    headers = await routed(rig, request((b"cookie", cookie)))
    assert headers[b"cookie"] == cookie and headers[b"x-ng-session-new"] == b"1"


async def refused(rig: Rig, data: bytes) -> str:
    """The detail of the 400 the proxy answers itself (no worker sees the request)."""
    client = rig.client()
    client.send(data)
    await rig.settle()
    [(status, _, body)] = client.responses()
    assert status == 400 and rig.upstreams == []
    error = orjson.loads(body)["error"]
    assert error["code"] == "invalid_session_token"
    return error["detail"]


async def test_a_non_ascii_token_with_this_instances_prefix_is_damaged():
    rig = Rig(workers=1)
    cookie = b"gym_proxy=" + rig.codec.prefix.encode() + b"\xe2\x98\x83.x.y"
    assert await refused(rig, request((b"cookie", cookie))) == "session token is not ASCII"


async def test_a_non_ascii_owner_hint_is_refused_in_one_line():
    rig = Rig(workers=1)
    detail = await refused(rig, request((b"x-ng-session-owner", b"caf\xc3\xa9")))
    assert detail == "x-ng-session-owner is not a valid owner ID"


async def test_every_copy_of_this_instances_token_must_verify():
    """One rule for both carriers: a damaged copy is refused wherever it is, two copies in
    one carrier must name one session, and the header wins over the cookie."""
    rig = Rig(workers=2)
    good = rig.codec.sign("s1", "owner0").encode()
    other = rig.codec.sign("s2", "owner1").encode()
    damaged = good[:-1] + (b"A" if good[-1:] != b"A" else b"B")
    both_cookies = b"gym_proxy=%s; gym_proxy=%s"
    for data in (
        request((b"cookie", both_cookies % (good, damaged))),
        request((b"cookie", both_cookies % (damaged, good))),
        request((TOKEN, good), (b"cookie", b"gym_proxy=" + damaged)),
    ):
        assert "does not verify" in await refused(rig, data)
    for data in (
        request((b"cookie", both_cookies % (good, other))),
        request((TOKEN, good), (TOKEN, other)),
        request((TOKEN, good), (TOKEN, damaged)),
        request((TOKEN, damaged), (TOKEN, good)),
    ):
        assert "different" in await refused(rig, data)
    headers = await routed(rig, request((b"cookie", both_cookies % (good, good))))
    assert headers[SESSION_ID] == b"s1"
    headers = await routed(rig, request((TOKEN, other), (b"cookie", b"gym_proxy=" + good)))
    assert headers[SESSION_ID] == b"s2"


async def test_a_token_of_a_gone_owner_is_410_after_the_token_checks():
    """The routing's own refusals pass the same path as a damaged token's (the compiled
    exchange once mistook one for the other)."""
    rig = Rig(workers=1)
    client = rig.client()
    client.send(request((TOKEN, rig.codec.sign("s1", "gone-owner").encode())))
    await rig.settle()
    [(status, _, body)] = client.responses()
    assert status == 410 and orjson.loads(body)["error"]["code"] == "session_owner_gone"

"""Tokens through the real proxy: bad ones never reach a worker; owners are honoured."""

from __future__ import annotations

import asyncio
import base64

import pytest

from gym_proxy.proxy.data_path.session_tokens import TokenCodec
from tests.conftest import BOTH_APP_KINDS
from tests.support import TEST_SECRET, v1_token

TOKEN = "X-NeMo-Gym-Session-Token"
OWNER = "x-ng-session-owner"
# The one cookie name of gym-proxy's pre-release tokens: now just another app's cookie.
V1_COOKIE = "ng_session"


async def owners_and_seen(http, url, owners):
    """Paths each worker has seen, asked through the owner header."""
    seen = {}
    for owner in owners:
        async with http.get(f"{url}/seen", headers={OWNER: owner}) as resp:
            body = await resp.json()
            assert body["owner"] == owner
            seen[owner] = body["paths"]
    return seen


async def discover_owners(http, url, count):
    owners = set()
    for _ in range(count * 4):
        async with http.post(f"{url}/whoami") as resp:
            owners.add((await resp.json())["owner"])
    assert len(owners) == count
    return sorted(owners)


def forged_tokens(valid: str) -> dict[str, str]:
    """Tokens that carry this instance's tag but are damaged or forged."""
    version, tag, sid, owner, mac = valid.split(".")
    return {
        "forged-owner": f"{version}.{tag}.{sid}.someoneelse.{mac}",
        "truncated": valid[:-5],
        "garbage": f"{version}.{tag}.not-a-token",
        "bad-chars": f"{version}.{tag}.a%20b.c.d",
    }


def foreign_tokens(valid: str, owner: str) -> dict[str, str]:
    """Tokens that are not this instance's: another instance's (same secret, other name),
    another secret's, and the pre-release `v1.` shape, even signed with this secret and
    naming this session and its live owner."""
    _, _, sid, _, _ = valid.split(".")
    return {
        "another-instance": TokenCodec(TEST_SECRET.encode(), "agent").sign(sid, owner),
        "another-secret": TokenCodec(b"another-secret", "apps").sign(sid, owner),
        "v1-this-secret-live-owner": v1_token(TEST_SECRET.encode(), sid, owner),
        "v1-another-secret": v1_token(b"another-secret", sid, owner),
    }


@pytest.mark.parametrize("carrier", ["header", "cookie"])
async def test_damaged_tokens_of_this_instance_are_400_and_reach_no_worker(
    shared_proxy, http, carrier
):
    proxy = shared_proxy(workers=2)
    owners = await discover_owners(http, proxy.url, 2)
    async with http.post(f"{proxy.url}/seed_session", json={"initial_count": 1}) as resp:
        valid = resp.headers[TOKEN]
    before = await owners_and_seen(http, proxy.url, owners)
    for name, token in forged_tokens(valid).items():
        headers = (
            {TOKEN: token} if carrier == "header" else {"Cookie": f"a=b; {proxy.cookie}={token}"}
        )
        async with http.post(
            f"{proxy.url}/increment_counter", json={"count": 1}, headers=headers
        ) as resp:
            assert resp.status == 400, name
            body = await resp.json()
            assert body["error"]["code"] == "invalid_session_token", name
    after = await owners_and_seen(http, proxy.url, owners)
    for owner in owners:
        # only the /seen calls of the first round were added
        assert after[owner] == before[owner] + ["/seen"], (owner, after[owner])


async def test_tokens_this_instance_did_not_mint_pass_through_untouched(shared_proxy, http):
    """Cookies travel between the servers of a NeMo Gym stack: another instance's token,
    another secret's, a `v1.` token (whatever it names) are none of its business. They
    reach the app untouched, never 400 or 410; a cookie client gets a new session of this
    instance's, a header (an app's token) gets none."""
    proxy = shared_proxy(workers=2)
    async with http.post(f"{proxy.url}/seed_session", json={"initial_count": 1}) as resp:
        valid = resp.headers[TOKEN]
    owner = valid.split(".")[3]
    for name, token in foreign_tokens(valid, owner).items():
        cookie = f"gym_proxy___agent={token}; {V1_COOKIE}={token}"
        async with http.post(f"{proxy.url}/whoami", headers={"Cookie": cookie}) as resp:
            assert resp.status == 200, (name, await resp.text())
            seen = (await resp.json())["headers"]
            assert seen["cookie"] == cookie, name
            assert resp.headers[TOKEN] != token and proxy.cookie in resp.cookies, name
        async with http.post(f"{proxy.url}/whoami", headers={TOKEN: token}) as resp:
            assert resp.status == 200, (name, await resp.text())
            seen = (await resp.json())["headers"]
            assert seen[TOKEN.lower()] == token and "x-ng-session-id" not in seen, name
            assert TOKEN not in resp.headers and "Set-Cookie" not in resp.headers, name


async def test_a_v1_token_of_a_live_owner_opens_no_session(shared_proxy, http):
    """The pre-release `v1.` token, signed with this instance's secret and naming a live
    owner, in the `ng_session` cookie or in this instance's own: no session is taken from
    it (identity only from a token this instance verified). Each request is a new session
    on whichever worker, the cookie reaches the app as sent, and only this instance's
    cookie is set."""
    proxy = shared_proxy(workers=2)
    owners = await discover_owners(http, proxy.url, 2)
    token = v1_token(TEST_SECRET.encode(), "old-session", owners[1])
    for name in (V1_COOKIE, proxy.cookie):
        sessions = set()
        for _ in range(3):
            cookie = f"{name}={token}"
            async with http.post(f"{proxy.url}/whoami", headers={"Cookie": cookie}) as resp:
                body = await resp.json()
                assert body["session_id"] != "old-session", name
                assert body["headers"]["cookie"] == cookie, name
                assert body["headers"]["x-ng-session-new"] == "1", name
                assert resp.cookies[proxy.cookie].value == resp.headers[TOKEN], name
                assert V1_COOKIE not in resp.cookies, name
                sessions.add(body["session_id"])
        assert len(sessions) == 3, name


async def test_unknown_owner_is_410_and_owner_header_lands(in_process, http, test_app):
    proxy = await in_process(workers=3, app=test_app)
    owners = await discover_owners(http, proxy.url, 3)
    codec = TokenCodec(TEST_SECRET.encode(), "apps")  # this instance (--name apps)
    ghost = codec.sign("sess-x", "ghostowner")
    async with http.post(f"{proxy.url}/get_counter_value", headers={TOKEN: ghost}) as resp:
        assert resp.status == 410
        assert (await resp.json())["error"]["code"] == "session_owner_gone"
    for owner in owners:
        for _ in range(5):
            async with http.post(f"{proxy.url}/whoami", headers={OWNER: owner}) as resp:
                body = await resp.json()
                assert body["owner"] == owner
                assert resp.headers[TOKEN].split(".")[-2] == owner
    async with http.post(f"{proxy.url}/whoami", headers={OWNER: "nobody"}) as resp:
        assert resp.status == 410


async def test_worker_sees_identity_headers_not_client_copies(shared_proxy, http):
    proxy = shared_proxy(workers=2)
    headers = {
        "x-ng-session-id": "spoofed",
        "x-ng-session-token": "spoofed",
        "x-ng-episode-key": "spoofed",
        "Connection": "keep-alive, x-private-hop",
        "x-private-hop": "1",
        "Keep-Alive": "timeout=5",
        "X-Custom": "kept",
    }
    async with http.post(f"{proxy.url}/whoami", headers=headers) as resp:
        body = await resp.json()
        token = resp.headers[TOKEN]
    seen = body["headers"]
    assert seen["x-ng-session-id"] == token.split(".")[-3]
    assert seen["x-ng-session-token"] == token
    assert seen["x-custom"] == "kept"
    assert "keep-alive" not in seen
    assert "x-private-hop" not in seen  # named in Connection, so hop-by-hop
    assert "x-ng-episode-key" not in seen
    assert seen["x-ng-session-new"] == "1"  # the proxy minted this session
    # same session again: the worker gets the same ID, and no new cookie is set
    spoof = {TOKEN: token, "x-ng-session-new": "1"}  # a client cannot make a session new
    async with http.post(f"{proxy.url}/whoami", headers=spoof) as resp:
        again = await resp.json()
        assert "Set-Cookie" not in resp.headers
        assert "x-ng-session-new" not in again["headers"]
    assert again["session_id"] == body["session_id"] and again["owner"] == body["owner"]


async def test_ownerless_token_is_placed_once_and_keeps_its_token(shared_proxy, http):
    proxy = shared_proxy(workers=2)
    codec = TokenCodec(TEST_SECRET.encode(), "apps")  # this instance (--name apps)
    ownerless = codec.sign("restored-session", None)
    results = await asyncio.gather(
        *(http.post(f"{proxy.url}/whoami", headers={TOKEN: ownerless}) for _ in range(10))
    )
    owners = set()
    for resp in results:
        body = await resp.json()
        owners.add(body["owner"])
        assert body["session_id"] == "restored-session"
        assert TOKEN not in resp.headers and "Set-Cookie" not in resp.headers
        resp.release()
    assert len(owners) == 1


@BOTH_APP_KINDS
async def test_an_app_token_naming_no_session_reaches_the_app_with_no_session(
    in_process, http, test_app
):
    """What an MCP client sends after its session ended: the app's own token (not `v1.`)
    naming a session no worker announced. The proxy passes it on, mints nothing, and the
    app decides; asked for its gym-proxy session, the runtime says what is true."""
    proxy = await in_process(workers=2, app=test_app)
    dead = base64.urlsafe_b64encode(b'{"sid": "ended-session"}').rstrip(b"=").decode()
    for token in (f"{dead}.signature", "v2.something-else"):
        async with http.post(f"{proxy.url}/whoami", headers={TOKEN: token}) as resp:
            assert resp.status == 200, token
            assert TOKEN not in resp.headers and "Set-Cookie" not in resp.headers
            seen = (await resp.json())["headers"]
            assert seen[TOKEN.lower()] == token  # untouched
            assert "x-ng-session-id" not in seen and "x-ng-session-token" not in seen
        async with http.post(f"{proxy.url}/get_counter_value", headers={TOKEN: token}) as resp:
            assert resp.status == 404, token
            error = (await resp.json())["error"]
            assert error["code"] == "unknown_session", token
            assert "names no session a worker of this server holds" in error["detail"]

"""Many sessions through the proxy: every counter exact, sessions spread over workers."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest

from tests.conftest import BOTH_APP_KINDS

TOKEN = "X-NeMo-Gym-Session-Token"


async def _run_session(http: aiohttp.ClientSession, url: str, start: int) -> tuple[str, int]:
    async with http.post(f"{url}/seed_session", json={"initial_count": start}) as resp:
        assert resp.status == 200
        token = resp.headers[TOKEN]
        assert f"gym_proxy___apps={token}" in resp.headers["Set-Cookie"]
    for _ in range(5):
        async with http.post(
            f"{url}/increment_counter", json={"count": 2}, headers={TOKEN: token}
        ) as resp:
            assert resp.status == 200
            assert "Set-Cookie" not in resp.headers  # unchanged session: no new cookie
    async with http.post(
        f"{url}/verify", json={"expected_count": start + 10}, headers={TOKEN: token}
    ) as resp:
        assert (await resp.json())["reward"] == 1.0
    owner = token.split(".")[-2]
    return owner, start


@pytest.mark.parametrize("workers", [2, 4])
@BOTH_APP_KINDS
async def test_counters_exact_and_spread(in_process, http, workers, test_app):
    proxy = await in_process(workers=workers, app=test_app)
    results = await asyncio.gather(*(_run_session(http, proxy.url, i) for i in range(200)))
    per_owner = Counter(owner for owner, _ in results)
    assert len(per_owner) == workers, per_owner
    fair = 200 / workers
    assert max(per_owner.values()) <= 2 * fair, per_owner


@BOTH_APP_KINDS
async def test_cookie_session_round_trip(in_process, test_app):
    """A browser-style client: the cookie alone carries the session."""
    proxy = await in_process(workers=2, app=test_app)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.post(f"{proxy.url}/seed_session", json={"initial_count": 7}) as resp:
            cookie = resp.headers["Set-Cookie"]
            assert "HttpOnly" in cookie and "SameSite=Lax" in cookie
            assert resp.headers["Cache-Control"] == 'no-cache="Set-Cookie"'
        for _ in range(3):
            async with http.post(f"{proxy.url}/increment_counter", json={"count": 1}) as resp:
                assert resp.status == 200
        async with http.post(f"{proxy.url}/get_counter_value") as resp:
            assert (await resp.json())["count"] == 10

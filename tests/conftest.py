from __future__ import annotations

from collections.abc import Callable, Iterator

import aiohttp
import pytest

from tests.support import ProxyProcess

TEST_APP = "tests.apps:create_app"


@pytest.fixture
def start_proxy() -> Iterator[Callable[..., ProxyProcess]]:
    """Start real gym-proxy processes; every one is stopped (and its workers reaped) after."""
    started: list[ProxyProcess] = []

    def start(
        *args: str,
        workers: int = 2,
        app: str | None = TEST_APP,
        ready: bool = True,
        **kwargs: object,
    ) -> ProxyProcess:
        proxy = ProxyProcess(*args, workers=workers, app=app, **kwargs)  # type: ignore[arg-type]
        started.append(proxy)
        return proxy.wait_ready() if ready else proxy

    yield start
    for proxy in started:
        proxy.close()


@pytest.fixture
async def http() -> aiohttp.ClientSession:
    """A client that keeps no cookies: tests pass session tokens explicitly."""
    async with aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout(total=30)
    ) as session:
        yield session

"""ASGI apps under gym-proxy: lifespan startup and shutdown, a bare app without lifespan.
NeMo Gym's own FastAPI servers are tested against the released package itself (the NeMo
Gym tier, tests/test_nemo_gym_*.py)."""

from __future__ import annotations

import asyncio

from tests.support import ProxyProcess


def test_lifespan_startup_failure_stops_the_server(tmp_path):
    proxy = ProxyProcess(workers=2, app="tests.asgi_apps:broken_lifespan")
    try:
        assert proxy.wait_exit(60) == 3
        log = proxy.log()
        assert "cannot connect to the database" in log
        assert "cannot build app tests.asgi_apps:broken_lifespan" in log
    finally:
        proxy.close()


async def test_bare_asgi_app_without_lifespan(start_proxy, http):
    proxy = start_proxy(workers=1, app="tests.asgi_apps:bare_asgi")
    async with http.get(f"{proxy.url}/ng-rollout/r1/any/path") as resp:
        assert (await resp.text()) == "/ng-rollout/r1/any/path"  # the prefix reaches ASGI apps


async def test_sigterm_runs_lifespan_shutdown_and_exits(start_proxy, http):
    proxy = start_proxy(workers=2, app="tests.asgi_apps:create_app")
    async with http.get(f"{proxy.url}/whoami") as resp:
        assert resp.status == 200
    proxy.signal(15)
    assert await asyncio.to_thread(proxy.wait_exit, 30) == 0
    assert proxy.log().count("Application shutdown complete") == 2  # each worker's

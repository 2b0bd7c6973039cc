"""`/metrics` with real processes: a real Prometheus (Debian's `prometheus`, which
`.ci/run` installs) scrapes a running gym-proxy with 2 workers under load, through a
checkpoint and a worker's kill -9; the values read back through Prometheus' HTTP API
must equal what the test did. `promtool check metrics` must find nothing to say."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import pytest

from tests.ports import free_port
from tests.support import (
    CONTROL_TOKEN,
    REPO,
    Control,
    ProxyProcess,
    wait_until,
    wait_until_sync,
)

if TYPE_CHECKING:
    from tests.in_process import InProcessProxy

TOKEN = "X-NeMo-Gym-Session-Token"
pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="Debian's prometheus package is not installed (.ci/run installs it)",
)


def metrics_url(proxy: ProxyProcess | InProcessProxy) -> str:
    found = wait_until_sync(
        lambda: re.search(r"metrics on (http://\S+/metrics)", proxy.log()), 10, "metrics address"
    )
    return found.group(1)


class Prometheus:
    """A real Prometheus on a loopback port, scraping one target every 0.5 s."""

    def __init__(self, target: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpprom-", dir="/tmp"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = self.dir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\n"
            "scrape_configs:\n  - job_name: gym-proxy\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.log = open(self.dir / "prometheus.log", "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    async def ready(self, http: aiohttp.ClientSession) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited: {(self.dir / 'prometheus.log').read_text()}")
        try:
            async with http.get(f"{self.url}/-/ready") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    async def query(self, http: aiohttp.ClientSession, expr: str) -> list[dict]:
        async with http.get(f"{self.url}/api/v1/query", params={"query": expr}) as response:
            body = await response.json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    async def value(self, http: aiohttp.ClientSession, expr: str) -> float | None:
        result = await self.query(http, expr)
        return float(result[0]["value"][1]) if result else None

    async def until(self, http: aiohttp.ClientSession, expr: str, expected: float) -> None:
        """Wait until Prometheus has scraped a state in which `expr` is `expected`."""

        async def equal() -> bool:
            return await self.value(http, expr) == expected

        try:
            await wait_until(equal, 30, f"{expr} == {expected}")
        except AssertionError:
            seen = await self.value(http, expr)
            raise AssertionError(f"{expr} is {seen}, not {expected}") from None

    def close(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def prometheus_for() -> Iterator[Callable[[str], Prometheus]]:
    started: list[Prometheus] = []

    def start(target: str) -> Prometheus:
        started.append(Prometheus(target))
        return started[-1]

    yield start
    for prom in started:
        prom.close()


async def post(http: aiohttp.ClientSession, url: str, path: str, token: str | None, **body):
    headers = {TOKEN: token} if token else {}
    async with http.post(f"{url}{path}", json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        return response.headers.get(TOKEN)


async def test_prometheus_scrapes_what_the_server_did(start_proxy, prometheus_for, tmp_path):
    proxy = start_proxy("--metrics", "127.0.0.1:0", workers=2, control_token=CONTROL_TOKEN)
    target = metrics_url(proxy).removeprefix("http://").removesuffix("/metrics")
    prom = prometheus_for(target)
    async with aiohttp.ClientSession() as http:
        await wait_until(lambda: prom.ready(http), 60, "prometheus to be ready")
        await prom.until(http, 'up{job="gym-proxy"}', 1)
        seeds, increments = 40, 200
        tokens = [
            await post(http, proxy.url, "/seed_session", None, initial_count=0)
            for _ in range(seeds)
        ]
        await asyncio.gather(
            *(
                post(http, proxy.url, "/increment_counter", tokens[i % seeds], count=1)
                for i in range(increments)
            )
        )
        async with http.get(f"{proxy.url}/whoami", headers={TOKEN: proxy.bad_token}) as response:
            assert response.status == 400
        await prom.until(
            http, 'sum(gym_proxy_worker_responses_total{code_class="2xx"})', seeds + increments
        )
        await prom.until(http, 'gym_proxy_routing_decisions_total{rule="new"}', seeds)
        await prom.until(http, 'gym_proxy_routing_decisions_total{rule="token"}', increments)
        await prom.until(http, 'gym_proxy_errors_total{code="invalid_session_token"}', 1)
        await prom.until(http, "sum(gym_proxy_worker_sessions)", seeds)
        await prom.until(http, 'sum(gym_proxy_workers{state="ready"})', 2)

        control = Control(http, proxy.url)
        reply = await control.ok("prepare", checkpoint_id="ck-metrics")
        assert reply["phase"] == "prepared"
        await prom.until(http, 'gym_proxy_checkpoint_phase{phase="prepared"}', 1)
        await control.ok("commit", checkpoint_id="ck-metrics", checkpoint_dir=str(tmp_path))
        await control.ok("resume", checkpoint_id="ck-metrics")
        await prom.until(http, 'gym_proxy_checkpoint_phase{phase="idle"}', 1)
        await prom.until(http, 'gym_proxy_checkpoint_records_total{direction="written"}', seeds)
        written = sum(p.stat().st_size for p in tmp_path.rglob("records-*.jsonl"))
        await prom.until(http, 'gym_proxy_checkpoint_bytes_total{direction="written"}', written)
        for op in ("prepare", "commit", "resume"):
            expr = f'gym_proxy_checkpoint_operation_seconds_count{{operation="{op}",outcome="ok"}}'
            await prom.until(http, expr, 1)

        # kill -9 worker 0: its slot's counters go on from where they were
        victim = int((await control.ok("status"))["workers"][0]["pid"])
        before = await prom.value(
            http, 'gym_proxy_worker_responses_total{slot="0",code_class="2xx"}'
        )
        start_before = await prom.value(http, 'gym_proxy_worker_start_time_seconds{slot="0"}')
        os.kill(victim, signal.SIGKILL)
        await prom.until(http, 'gym_proxy_worker_restarts_total{slot="0",reason="exit"}', 1)
        await prom.until(http, 'sum(gym_proxy_workers{state="ready"})', 2)
        fresh = [
            await post(http, proxy.url, "/seed_session", None, initial_count=0) for _ in range(20)
        ]
        total = seeds + increments + len(fresh)
        await prom.until(http, 'sum(gym_proxy_worker_responses_total{code_class="2xx"})', total)
        assert (
            await prom.value(http, 'gym_proxy_worker_responses_total{slot="0",code_class="2xx"}')
        ) >= before
        resets = await prom.query(http, "resets(gym_proxy_worker_responses_total[5m]) > 0")
        assert resets == [], resets
        start_after = await prom.value(http, 'gym_proxy_worker_start_time_seconds{slot="0"}')
        assert start_after is not None and start_before is not None and start_after > start_before


async def test_promtool_finds_nothing_to_say(start_proxy, tmp_path):
    """The exposition, after traffic, a checkpoint and a move, passes promtool's lint."""
    proxy = start_proxy("--metrics", "127.0.0.1:0", workers=2, control_token=CONTROL_TOKEN)
    async with aiohttp.ClientSession() as http:
        token = await post(http, proxy.url, "/seed_session", None, initial_count=0)
        await post(http, proxy.url, "/increment_counter", token, count=1)
        control = Control(http, proxy.url)
        await control.checkpoint("ck-lint", str(tmp_path))
        await control.ok("resume", checkpoint_id="ck-lint")
        async with http.get(f"{proxy.url}/whoami", headers={TOKEN: token}) as response:
            where = await response.json()
        move = {"session_ids": [where["session_id"]], "to_slot": 1 - where["slot"]}
        async with http.post(
            f"{proxy.url}/ng-control/v1/gym-proxy/sessions/move",
            json=move,
            headers={"Authorization": f"Bearer {CONTROL_TOKEN}"},
        ) as response:
            assert (await response.json())["moved"] == move["session_ids"]
        async with http.get(metrics_url(proxy)) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain; version=")
            text = await response.read()
    lint = await asyncio.create_subprocess_exec(
        "promtool",
        "check",
        "metrics",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    said, _ = await asyncio.wait_for(lint.communicate(text), 30)
    assert lint.returncode == 0 and not said, said
    assert b"gym_proxy_checkpoint_operation_seconds_bucket" in text
    assert b"gym_proxy_sessions_moved_total 1.0" in text
    session_id = token.split(".")[2]  # v2.<instance>.<session>.<owner>.<mac>
    assert session_id.encode() not in text and token.encode() not in text


async def test_the_dashboard_shows_only_families_the_server_exposes(start_proxy):
    """Every metric the Grafana dashboard queries is one a running server exposes."""
    proxy = start_proxy("--metrics", "127.0.0.1:0", workers=1)
    async with aiohttp.ClientSession() as http, http.get(metrics_url(proxy)) as response:
        text = (await response.read()).decode()

    def family(name: str) -> str:
        return re.sub(r"_(bucket|count|sum|total)$", "", name)

    # Declared families: a labelled family with no sample yet still has its HELP line.
    exposed = {family(name) for name in re.findall(r"(?m)^# HELP (gym_proxy_\w+)", text)}
    dashboard = json.loads((REPO / "proxy" / "metrics" / "grafana_dashboard.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", ())
        for name in re.findall(r"gym_proxy_\w+", target["expr"])
    }
    queried = {family(name) for name in queried}
    assert len(queried) >= 24, queried
    assert queried <= exposed, sorted(queried - exposed)

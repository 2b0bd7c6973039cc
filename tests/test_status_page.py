"""The status page (`/status` on the metrics listener, proxy/metrics/status_page.py),
loaded in a real headless Chromium (Debian's, tests/install_chromium.sh): its script
reads `/status.json` with the control token and draws every worker; a worker whose loop
a handler blocks shows as stalled, and the rebalance that moved its idle sessions is
listed with each session and where it went. `/status.json` needs the token where one is
set (401 without); a page without one shows no session ID."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest

from gym_proxy.proxy.metrics.status_page import _hide_sessions
from tests.support import CONTROL_TOKEN, Control, wait_until
from tests.test_live_operations import count, whoami
from tests.test_metrics import metrics_url
from tests.test_rebalance import increment, sessions_by_slot, stalling

CHROMIUM = shutil.which("chromium")
APP = "tests.apps:create_app"


def chromium_dom(url: str, screenshot: Path | None = None) -> str:
    """The page's DOM once its script ran (Chromium's virtual time: its first reads done)."""
    assert CHROMIUM is not None
    shot = [f"--screenshot={screenshot}", "--window-size=1100,720"] if screenshot else []
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--virtual-time-budget=3000", *shot, "--dump-dom", url],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (tests/install_chromium.sh)")
@pytest.mark.parametrize("test_app", [APP], indirect=True)
async def test_the_status_page_shows_a_stalled_worker_and_its_rebalance(
    start_proxy, http, tmp_path
):
    proxy = start_proxy(
        "--rebalance", "--stall-threshold", "0.5", "--metrics", "127.0.0.1:0",
        workers=2, control_token=CONTROL_TOKEN,
    )  # fmt: skip
    base = metrics_url(proxy).removesuffix("/metrics")
    async with http.get(f"{base}/status.json") as resp:
        assert resp.status == 401  # the control token is needed, as for the control calls
    async with http.get(f"{base}/status") as resp:
        assert resp.status == 200 and resp.content_type == "text/html"
        page = await resp.text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # no external asset
    assert CONTROL_TOKEN not in page

    light, others = await sessions_by_slot(http, proxy.url, 4)
    heavy, *light = light
    for token in light:
        await increment(http, proxy.url, token, 1)
    control = Control(http, proxy.url)
    ids = {(await whoami(http, proxy.url, t))["session_id"] for t in light}
    async with stalling(http, proxy.url, heavy):

        async def moved() -> bool:
            recent = (await control.ok("status"))["rebalance"]["recent"]
            return ids <= {sid for event in recent for sid in event["moved"]}

        await wait_until(moved, 30, "the stalled worker's idle sessions to move")
        held = {0: 1, 1: len(light) + len(others)}  # each worker says it at its pings

        async def counted() -> bool:
            workers = (await control.ok("status"))["workers"]
            return {w["slot"]: w["sessions"] for w in workers} == held

        await wait_until(counted, 30, "each worker's session count")
        url = f"{base}/status#token={CONTROL_TOKEN}"
        # GYM_PROXY_STATUS_SHOT=docs/status_page.png refreshes the docs' screenshot.
        shot = Path(os.environ.get("GYM_PROXY_STATUS_SHOT") or tmp_path / "status.png")
        dom = await asyncio.to_thread(chromium_dom, url, shot)
    drawn = await asyncio.to_thread(lambda: shot.stat().st_size)
    assert drawn > 10_000  # a page was drawn (docs/status_page.png is one)
    rows = re.findall(r'<tr class="([a-z]*)" data-slot="(\d)">(.*?)</tr>', dom)
    assert sorted(slot for _, slot, _ in rows) == ["0", "1"], dom
    by_slot = {slot: (cls, cells) for cls, slot, cells in rows}
    assert by_slot["0"][0] == "stalled" and "ready, stalled" in by_slot["0"][1], dom
    assert by_slot["1"][0] == "", dom
    events = dom.split('id="rebalances"', 1)[1]
    assert "stalled: event-loop lag" in events, events
    for sid in ids:  # each session moved, named (the page had the control token)
        assert sid in events, (sid, events)
    assert "off (no --max-workers)" in dom and "phase idle" in dom, dom
    assert "Last commit: none. Last restore: none." in dom, dom
    assert CONTROL_TOKEN not in dom
    assert [await count(http, proxy.url, t) for t in light] == [1] * len(light)


def test_without_a_control_token_the_status_shows_no_session():
    """Open to whoever reaches the metrics port: what a rebalance moved is counted per
    worker, a checkpoint's session blockers are counted, the alias table is left out."""
    said = {
        "rebalance": {"recent": [{
            "moved": {"sA": "w1", "sB": "w1", "sC": "w2"}, "not_moved": {"sD": "gone"},
            "kept": {}, "at": 0.0, "slot": 0, "owner": "w0", "reason": "stalled", "why": "",
        }]},
        "report": {"blockers": ["session:sE", "worker-unreported:w3", "session:sF"]},
        "session_aliases": {"w9": "w1"},
    }  # fmt: skip
    _hide_sessions(said)
    event = said["rebalance"]["recent"][0]  # type: ignore[index]
    assert event["moved"] == {"2 sessions": "w1", "1 session": "w2"}
    assert (event["not_moved"], event["kept"]) == ({"1 not moved": ""}, {})
    blockers = said["report"]["blockers"]  # type: ignore[index]
    assert blockers == ["worker-unreported:w3", "2 sessions with a request running"]
    assert said["session_aliases"] is None
    assert not re.search(r"\bs[A-F]\b", str(said))


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (tests/install_chromium.sh)")
@pytest.mark.parametrize("test_app", [APP], indirect=True)
async def test_the_page_asks_for_the_token_it_needs(start_proxy, http: aiohttp.ClientSession):
    proxy = start_proxy("--metrics", "127.0.0.1:0", workers=1, control_token=CONTROL_TOKEN)
    base = metrics_url(proxy).removesuffix("/metrics")
    dom = await asyncio.to_thread(chromium_dom, f"{base}/status")
    assert '<form id="login">' in dom, dom  # shown: no token given
    dom = await asyncio.to_thread(chromium_dom, f"{base}/status#token=wrong")
    assert '<form id="login">' in dom and 'data-slot="0"' not in dom, dom

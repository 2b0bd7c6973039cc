"""Bodies stream through the proxy both ways, with bounded proxy memory."""

from __future__ import annotations

import asyncio
import hashlib
import io
from pathlib import Path

from tests.apps import pattern_block
from tests.conftest import BOTH_APP_KINDS

TOKEN = "X-NeMo-Gym-Session-Token"
SIZE = 50 * 1024 * 1024


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


async def new_session(http, url):
    async with http.post(f"{url}/whoami") as resp:
        return resp.headers[TOKEN]


@BOTH_APP_KINDS
async def test_sse_arrives_event_by_event(start_proxy, http):
    proxy = start_proxy(workers=2)
    token = await new_session(http, proxy.url)
    headers = {TOKEN: token}
    async with http.get(f"{proxy.url}/sse?name=s1&n=4", headers=headers) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        for i in range(4):
            line = await asyncio.wait_for(resp.content.readline(), 10)
            assert line == f"data: event-{i}\n".encode()
            assert await resp.content.readline() == b"\n"
            # event i+1 is only produced after this release: it cannot have been buffered
            if i < 3:
                async with http.post(f"{proxy.url}/release?name=s1-{i}", headers=headers) as r:
                    assert r.status == 200
        assert await resp.content.read() == b""


@BOTH_APP_KINDS
async def test_50mb_upload_and_download_intact_with_bounded_memory(start_proxy, http):
    proxy = start_proxy(workers=2)
    token = await new_session(http, proxy.url)
    headers = {TOKEN: token}
    baseline = peak_rss_kib(proxy.pid)
    block = pattern_block(7)
    expected = hashlib.sha256()
    for _ in range(SIZE // len(block)):
        expected.update(block)

    async def body():
        for _ in range(SIZE // len(block)):
            yield block

    # chunked upload (no Content-Length)
    async with http.post(f"{proxy.url}/upload", data=body(), headers=headers) as resp:
        assert await resp.json() == {"sha256": expected.hexdigest(), "size": SIZE}
    # upload with Content-Length
    whole = block * (SIZE // len(block))
    async with http.post(f"{proxy.url}/upload", data=io.BytesIO(whole), headers=headers) as resp:
        assert (await resp.json())["sha256"] == expected.hexdigest()
    del whole
    for length in ("0", "1"):  # chunked download, then with Content-Length
        got = hashlib.sha256()
        size = 0
        async with http.get(
            f"{proxy.url}/download?size={SIZE}&seed=7&length={length}", headers=headers
        ) as resp:
            async for piece in resp.content.iter_chunked(1 << 16):
                got.update(piece)
                size += len(piece)
        assert size == SIZE and got.hexdigest() == expected.hexdigest()
    grown_mib = (peak_rss_kib(proxy.pid) - baseline) / 1024
    assert grown_mib < 20, f"proxy peak memory grew by {grown_mib:.1f} MiB"


@BOTH_APP_KINDS
async def test_slow_reader_does_not_make_the_proxy_buffer(start_proxy, http):
    proxy = start_proxy(workers=1)
    token = await new_session(http, proxy.url)
    baseline = peak_rss_kib(proxy.pid)
    async with http.get(f"{proxy.url}/download?size={SIZE}&seed=1", headers={TOKEN: token}) as resp:
        first = await resp.content.readexactly(1 << 16)
        assert first == pattern_block(1)
        # the client stops reading; the worker keeps writing into a full pipe
        await asyncio.sleep(1.0)
        stalled = (peak_rss_kib(proxy.pid) - baseline) / 1024
        rest = 0
        async for piece in resp.content.iter_chunked(1 << 16):
            rest += len(piece)
    assert rest == SIZE - (1 << 16)
    assert stalled < 20, f"proxy buffered {stalled:.1f} MiB for a stalled client"

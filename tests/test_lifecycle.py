"""Start-up checks, the private runtime directory, and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, pid_alive, wait_until, wait_until_sync

OWNER = "x-ng-session-owner"


async def test_sigterm_finishes_in_flight_then_exits_cleanly(start_proxy, http):
    proxy = start_proxy(workers=2)
    runtime = proxy.runtime_dir()
    workers = proxy.worker_pids()
    owners = set()
    for _ in range(4):
        async with http.post(f"{proxy.url}/whoami") as resp:
            owners.add((await resp.json())["owner"])
    slow = [
        asyncio.create_task(http.get(f"{proxy.url}/slow?seconds=1.5&tag={i}")) for i in range(6)
    ]

    async def all_arrived():
        count = 0
        for owner in owners:
            async with http.get(f"{proxy.url}/seen", headers={OWNER: owner}) as resp:
                count += (await resp.json())["paths"].count("/slow")
        return count == 6

    await wait_until(all_arrived, 10, "all slow requests to reach the workers")
    proxy.signal(signal.SIGTERM)
    responses = await asyncio.gather(*slow)
    assert [r.status for r in responses] == [200] * 6
    for resp in responses:
        assert (await resp.json())["slept"] == 1.5
    assert await asyncio.to_thread(proxy.wait_exit, 30) == 0
    assert not runtime.exists()
    assert not any(pid_alive(p) for p in workers)


def test_runtime_directory_is_private(start_proxy):
    proxy = start_proxy(workers=2)
    runtime = proxy.runtime_dir()
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    sockets = sorted(p.name for p in runtime.iterdir() if p.is_socket())
    assert "coordinator.sock" in sockets and "control.sock" in sockets
    assert sum(name.startswith("w") for name in sockets) == 2
    # Nothing listens on TCP beyond the address given: the proxy has its public socket,
    # the workers none at all.
    assert tcp_listening(proxy.pid) == {f"0100007F:{proxy.port:04X}"}
    for pid in proxy.worker_pids():
        assert tcp_listening(pid) == set()


def tcp_listening(pid: int) -> set[str]:
    """Local addresses of TCP sockets in LISTEN state held by `pid` (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            row = line.split()
            if row[3] == "0A" and row[9] in inodes:
                found.add(row[1])
    return found


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args], cwd=REPO, text=True, capture_output=True, timeout=60
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "--workers must be at least 1"),
        (["no_such_module:app"], "cannot import module 'no_such_module'"),
        (["worker.counter:nothing"], "has no attribute 'nothing'"),
        (["worker.counter"], "APP must look like module:attr"),
        (["--port", "70000"], "--port must be between 0 and 65535"),
    ],
)
def test_bad_flags_exit_with_one_line(args, message, tmp_path):
    result = run_cli(*args, "--runtime-dir", str(tmp_path))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing started, no runtime directory


def test_version_and_help():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("gym-proxy 0.")
    result = run_cli("--help")
    assert result.returncode == 0
    for flag in ("--workers", "--control-token", "--lease-grace", "--fd", "GYM_PROXY_SECRET"):
        assert flag in result.stdout


def test_port_in_use_fails_before_any_worker(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        result = run_cli("--port", str(port), "--runtime-dir", str(tmp_path))
    finally:
        taken.close()
    assert result.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "worker" not in result.stderr.lower().replace("--workers", "")
    assert list(tmp_path.iterdir()) == []


def test_default_app_is_counter(tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                "--fd",
                str(listener.fileno()),
                "--runtime-dir",
                str(tmp_path),
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=[listener.fileno()],
        )
    try:
        wait_until_sync(lambda: "ready on" in log.read_text(), 30, "default server")
        assert "no --secret" in log.read_text()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            body = b'{"initial_count": 4}'
            conn.sendall(
                b"POST /seed_session HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"count":4}')
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        listener.close()


async def test_access_log(start_proxy, http):
    proxy = start_proxy("--access-log", workers=1)
    async with http.post(f"{proxy.url}/seed_session", json={"initial_count": 1}) as resp:
        assert resp.status == 200
    async with http.get(f"{proxy.url}/x", headers={"X-NeMo-Gym-Session-Token": "bad"}) as resp:
        assert resp.status == 400

    def logged() -> bool:
        log = proxy.log()
        return (
            '127.0.0.1 "POST /seed_session HTTP/1.1" 200' in log and '"GET /x HTTP/1.1" 400' in log
        )

    wait_until_sync(logged, 10, "both requests in the access log")

"""Start-up checks, the private runtime directory, and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest

from tests.gated_app import GATE_ENV
from tests.ports import free_port
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


def run_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gym_proxy", *args],
        cwd=cwd,
        text=True,
        capture_output=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "--workers must be 1-256, got 0"),
        (["--workers", "100000"], "--workers must be 1-256, got 100000"),
        (["--workers", "2", "--max-workers", "300"], "--max-workers must be 0-256, got 300"),
        (["no_such_module:app"], "cannot import module 'no_such_module'"),
        (["gym_proxy.worker.counter:nothing"], "has no attribute 'nothing'"),
        (["gym_proxy.worker.counter"], "APP must look like module:attr"),
        (["--port", "70000"], "--port must be between 0 and 65535"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag (see gym-proxy --help)"),
        (["--wokers", "2"], "unrecognized arguments: --wokers; did you mean --workers? (see"),
        (["--local-workers", "1"], "--local-workers needs --worker-placement ray"),
        (["--worker-placement", "ray", "--local-workers", "3"], "--local-workers 3 must lie"),
        (["--placement-wait", "5"], "--placement-wait needs --worker-placement ray"),
        (["--workers", "two"], "argument --workers: invalid int value: 'two' (see gym-proxy"),
        (["--worker-cpus", "2"], "--worker-cpus needs --worker-placement ray"),
        (["--worker-placement", "ray", "--worker-resources", "[1]"], "must be a JSON object"),
        (["--worker-placement", "ray", "--worker-resources", '{"CPU": 1}'], "--worker-cpus"),
        (["--min-workers", "2"], "--min-workers needs --max-workers"),
        (["--rebalance-ratio", "3"], "--rebalance-ratio needs --rebalance"),
        (["--min-workers", "3", "--max-workers", "2"], "--min-workers 3 is over --max-workers 2"),
        (["-w", "4"], "unrecognized arguments: -w; for -w use --workers N (gunicorn's -w)"),
        (["--bind", "0.0.0.0:8000"], "for --bind use --host H --port P (gunicorn's --bind)"),
        (["--timeout", "30"], "for --timeout use --worker-timeout S for a silent worker"),
        (["--factory"], "for --factory no flag is needed: APP may name a factory"),
    ],
)
def test_bad_flags_exit_with_one_line(args, message, short_tmp):
    result = run_cli(*args, "--runtime-dir", str(short_tmp))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert list(short_tmp.iterdir()) == []  # nothing started, no runtime directory


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed")
@pytest.mark.parametrize("where", ["repo", "with a ray directory"])
def test_placing_workers_on_ray_without_ray_is_one_line_and_status_5(short_tmp, tmp_path, where):
    """Also where the working directory has a `ray` directory (Ray's own temp dir is
    /tmp/ray): a namespace package is not Ray."""
    cwd = REPO
    if where != "repo":
        (tmp_path / "ray").mkdir()
        cwd = tmp_path
    result = run_cli(
        "gym_proxy.worker.counter:create_app", "--worker-placement", "ray", "--runtime-dir",
        str(short_tmp), cwd=cwd,
    )  # fmt: skip
    assert result.returncode == 5
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs Ray" in lines[0], result.stderr
    assert list(short_tmp.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "code"), [(["--version"], 0), (["--help"], 0), (["--min-workers", "2"], 2)]
)
def test_the_command_line_is_answered_before_the_server_is_imported(args, code):
    """`--version`, `--help` and a mistake need neither aiohttp nor uvloop nor the app
    (issue 56: every typo imported the whole server first, 0.7 s of CPU)."""
    probe = (
        "import sys\n"
        "from gym_proxy.proxy.cli import main\n"
        "try:\n    main(sys.argv[1:])\n"
        "except SystemExit as exc:\n"
        "    heavy = sorted(m for m in ('aiohttp', 'uvloop', 'gym_proxy.proxy.server') "
        "if m in sys.modules)\n"
        "    print('exit', exc.code, heavy, file=sys.stderr)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60
    )
    assert result.stderr.strip().splitlines()[-1] == f"exit {code} []", result.stderr


def test_version_and_help():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("gym-proxy 0.")
    result = run_cli("--help")
    assert result.returncode == 0
    for flag in ("--workers", "--control-token", "--lease-grace", "--fd", "GYM_PROXY_SECRET"):
        assert flag in result.stdout


def test_port_in_use_fails_before_any_worker(short_tmp):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        result = run_cli("--port", str(port), "--runtime-dir", str(short_tmp))
    finally:
        taken.close()
    assert result.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "worker" not in result.stderr.lower().replace("--workers", "")
    assert list(short_tmp.iterdir()) == []


def _bound_by_someone(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def test_a_port_taken_while_the_workers_boot_stops_gym_proxy_with_one_line(tmp_path):
    # gym-proxy binds at once and listens when its workers are ready; another process
    # may bind and listen on the port in between (both with SO_REUSEADDR).
    hold = tmp_path / "hold"
    hold.touch()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gym_proxy", "tests.apps:create_app", "--port", str(port)],
        cwd=REPO,
        env={**os.environ, "GYM_TEST_HOLD_FILE": str(hold)},
        stderr=subprocess.PIPE,
        text=True,
    )
    taker = socket.socket()
    try:
        wait_until_sync(
            lambda: proc.poll() is not None or _bound_by_someone(port), 30, "gym-proxy's bind"
        )
        taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taker.bind(("127.0.0.1", port))
        taker.listen()
        hold.unlink()
        _, stderr = proc.communicate(timeout=60)
    finally:
        taker.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use; stopping" in stderr
    assert "Traceback" not in stderr
    assert "stopped in" in stderr  # after its workers, through the usual stop


def test_default_app_is_counter(tmp_path, short_tmp):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gym_proxy",
                "--fd",
                str(listener.fileno()),
                "--runtime-dir",
                str(short_tmp),
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=[listener.fileno()],
        )
    try:
        wait_until_sync(lambda: "ready on" in log.read_text(), 30, "default server")
        assert "no --secret" in log.read_text()
        assert re.search(r"ready on http://\S+ with 1 worker$", log.read_text(), re.M)
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
        listener.close()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
    assert code == 0


async def test_access_log(start_proxy, http):
    proxy = start_proxy("--access-log", workers=1)
    async with http.post(f"{proxy.url}/seed_session", json={"initial_count": 1}) as resp:
        assert resp.status == 200
    async with http.get(
        f"{proxy.url}/x", headers={"X-NeMo-Gym-Session-Token": proxy.bad_token}
    ) as resp:
        assert resp.status == 400

    def logged() -> bool:
        log = proxy.log()
        return (
            '127.0.0.1 "POST /seed_session HTTP/1.1" 200' in log and '"GET /x HTTP/1.1" 400' in log
        )

    wait_until_sync(logged, 10, "both requests in the access log")


def proc_cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def proc_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )


async def test_secrets_from_files_stay_out_of_argv_and_workers(start_proxy, http, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("file-secret\n")
    proxy = start_proxy(
        "--secret-file",
        str(secret_file),
        workers=2,
        secret=None,
        env={"GYM_PROXY_CONTROL_TOKEN": "env-token"},
    )
    async with http.get(
        f"{proxy.url}/ng-control/v1/checkpoint/status",
        headers={"Authorization": "Bearer env-token"},
    ) as resp:
        assert resp.status == 200
    cmdline = proc_cmdline(proxy.pid)
    assert b"file-secret" not in cmdline and b"env-token" not in cmdline
    for pid in proxy.worker_pids():
        environment = proc_environ(pid)
        assert "GYM_PROXY_SECRET" not in environment
        assert "GYM_PROXY_CONTROL_TOKEN" not in environment
        assert b"file-secret" not in proc_cmdline(pid)
    assert "visible to every local user" not in proxy.log()


def test_secret_flags_warn_and_files_are_checked(tmp_path):
    result = run_cli("--secret-file", str(tmp_path / "missing"))
    assert result.returncode == 2 and "--secret-file" in result.stderr
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    result = run_cli("--control-token-file", str(empty), "--secret", "s")
    assert result.returncode == 2 and "is empty" in result.stderr
    result = run_cli("--secret", "s", "--secret-file", str(empty))
    assert result.returncode == 2 and "exclude each other" in result.stderr


def test_command_line_secret_is_warned_about(start_proxy):
    proxy = start_proxy(workers=1)  # the test helper passes --secret on the command line
    assert "--secret on the command line is visible to every local user" in proxy.log()
    assert "restored.json" not in proxy.log()  # a fresh start has no restore to continue


def test_stale_runtime_directories_are_removed(start_proxy):
    first = start_proxy(workers=1)
    stale = first.runtime_dir()
    first.kill_all()
    assert stale.exists()
    old = stale.stat().st_mtime - 3600
    os.utime(stale, (old, old))
    unrelated = Path(first.runtime_parent) / "gym-proxy-not-ours"
    unrelated.mkdir()  # no lock file: not judged
    second = start_proxy("--runtime-dir", first.runtime_parent, workers=1)
    assert not stale.exists() and unrelated.exists()
    assert "removed the runtime directory of a dead instance" in second.log()
    live = [p for p in Path(first.runtime_parent).iterdir() if p.is_dir() and p != unrelated]
    assert len(live) == 1  # the second instance's own directory, untouched


def test_missing_runtime_dir_is_created_private(start_proxy, tmp_path):
    short = Path(tempfile.mkdtemp(prefix="gpt-", dir="/tmp"))  # socket paths stay short
    parent = short / "not" / "yet"
    proxy = start_proxy("--runtime-dir", str(parent), workers=1)
    assert stat.S_IMODE(parent.stat().st_mode) == 0o700
    assert [p.name.startswith("gym-proxy-") for p in parent.iterdir()] == [True]
    proxy.close_process()
    blocked = tmp_path / "file"
    blocked.write_text("")
    result = run_cli("--runtime-dir", str(blocked / "sub"))
    assert result.returncode == 2 and "--runtime-dir" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_cli("--runtime-dir", "/tmp/" + "d" * 80)
    assert result.returncode == 2 and "too long for Unix socket paths" in result.stderr
    shutil.rmtree(short)


async def test_sessions_end_on_close_verify_and_idle_ttl(start_proxy, http):
    proxy = start_proxy("--session-idle-ttl", "1", workers=1)
    token_header = "X-NeMo-Gym-Session-Token"

    async def store_size():
        async with http.get(f"{proxy.url}/sessions") as resp:
            return (await resp.json())["sessions"]

    tokens = []
    for i in range(3):
        async with http.post(f"{proxy.url}/seed_session", json={"initial_count": i}) as resp:
            tokens.append(resp.headers[token_header])
    assert await store_size() == 3
    async with http.post(f"{proxy.url}/close_session", headers={token_header: tokens[0]}) as resp:
        assert resp.status == 200
    async with http.post(
        f"{proxy.url}/verify", json={"expected_count": 1}, headers={token_header: tokens[1]}
    ) as resp:
        assert (await resp.json())["reward"] == 1.0
    assert await store_size() == 1  # ended by /close_session and by a resources /verify

    async def expired():
        return await store_size() == 0

    await wait_until(expired, 10, "the idle session to expire")


OPERATION_SIGNALS = (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU)


def blocked_signals(pid: int) -> set[int]:
    """The signals `pid` blocks (its SigBlk mask, from /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask >> (n - 1) & 1}
    raise AssertionError("no SigBlk")


def test_operation_signals_during_start_are_held_not_fatal(start_proxy, tmp_path):
    """HUP, TTIN and TTOU sent while gym-proxy imports APP (before its handlers exist)
    neither end it nor run: once its handlers are in place each is logged as ignored,
    and it starts; its workers do not inherit the blocked signals."""
    gate = tmp_path / "gate"
    gate.mkdir()
    proxy = start_proxy(
        workers=1, app="tests.gated_app:create_app", env={GATE_ENV: str(gate)}, ready=False
    )
    wait_until_sync(
        lambda: (gate / "importing").exists() or proxy.popen.poll() is not None,
        30,
        "gym-proxy to import APP",
    )
    for sig in OPERATION_SIGNALS:
        proxy.signal(sig)
    (gate / "go").touch()
    proxy.wait_ready()
    log = proxy.log()
    for sig in OPERATION_SIGNALS:
        assert f"{sig.name} ignored: gym-proxy is not serving" in log, log
    assert "worker 0 started" in log
    for pid in proxy.worker_pids():
        assert not blocked_signals(pid) & set(OPERATION_SIGNALS), pid


def test_a_stop_says_what_it_waits_for_and_lasts_as_long_as_its_workers(start_proxy):
    """SIGTERM to an idle server: the log says there is no request in flight, that the
    workers got SIGTERM (and when they would be killed), when each exited, and that the
    proxy stopped right after the last one (not seconds later)."""
    proxy = start_proxy(workers=2)
    began = time.monotonic()
    proxy.signal(signal.SIGTERM)
    assert proxy.wait_exit(30) == 0
    took = time.monotonic() - began
    log = proxy.log()
    assert "shutting down: no request in flight" in log, log
    assert "stopping 2 workers: SIGTERM sent; " in log and "still running in 30 s" in log, log
    exits = re.findall(r"worker \d \(pid \d+\) exited with code 0, ([0-9.]+) s after SIGTERM", log)
    assert len(exits) == 2, log
    stopped = float(re.findall(r"stopped in ([0-9.]+) s", log)[-1])
    assert stopped - max(map(float, exits)) < 1.0, log
    assert took < 10, (took, log)


async def test_a_stop_counts_only_the_connections_with_a_request_in_flight(start_proxy):
    """Two idle keep-alive connections and one with a request in flight at SIGTERM: the
    log waits for 1 connection, not 3 (issue 56: idle ones were counted as busy); the
    request in flight is answered."""
    proxy = start_proxy(workers=1)
    host, port = "127.0.0.1", int(proxy.url.rsplit(":", 1)[1])
    idle = []
    for _ in range(2):  # one request each, answered: then idle, kept alive
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /whoami HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        idle.append(writer)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET /slow?seconds=2 HTTP/1.1\r\nHost: x\r\n\r\n")

    async with aiohttp.ClientSession() as http:

        async def in_flight() -> bool:
            async with http.get(f"{proxy.url}/seen") as resp:
                return "/slow" in (await resp.json())["paths"]

        await wait_until(in_flight, 30, "the slow request to reach its worker")
    proxy.signal(signal.SIGTERM)
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)).startswith(b"HTTP/1.1 200")
    assert await asyncio.to_thread(proxy.wait_exit, 30) == 0
    assert "for 1 connections with requests in flight" in proxy.log(), proxy.log()
    for each in (*idle, writer):
        each.close()


def test_a_start_that_fails_says_its_one_line_and_no_warning_before_it(short_tmp):
    """A port in use, without a secret and with one on the command line: the error line
    only; the warnings (no secret, a secret others can read) belong to a start that
    goes on."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for secret in ((), ("--secret", "s3cret")):
            result = run_cli("--port", str(port), "--runtime-dir", str(short_tmp), *secret)
            assert result.returncode == 2
            assert result.stderr.strip().splitlines() == [
                f"gym-proxy: error: cannot listen on 127.0.0.1:{port}: Address already in use"
            ], result.stderr


def test_a_process_exits_without_the_final_collections(tmp_path):
    """exit_process: the exit code and atexit handlers as sys.exit's, with every object
    frozen first (the teardown's collections skip them)."""
    script = (
        "import atexit, gc\n"
        "from gym_proxy.coordinator.contract.exit_codes import exit_process\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0, flush=True))\n"
        "exit_process(3)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stdout) == (3, "frozen True\n"), result


def test_killing_the_process_group_kills_this_instance_and_its_workers(start_proxy):
    """The crash of docs/checkpoints.md's walk-through: gym-proxy's workers are in its
    process group, so `kill -9 -- -PGID` (a shell job's group) ends this instance whole
    and nothing else."""
    proxy = start_proxy(workers=2, new_session=True)
    bystander = start_proxy(workers=1)
    group = os.getpgid(proxy.pid)
    assert group == proxy.pid
    workers = proxy.worker_pids()
    assert len(workers) == 2 and {os.getpgid(pid) for pid in workers} == {group}
    os.killpg(group, signal.SIGKILL)
    proxy.popen.wait(10)
    wait_until_sync(lambda: not any(pid_alive(p) for p in workers), 10, "the workers to die")
    assert bystander.popen.poll() is None and all(map(pid_alive, bystander.worker_pids()))

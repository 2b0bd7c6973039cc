"""Take-over and adoption believe only this user and the kernel (issue 53, A): another
user's directory or socket under a shared parent never hears the secret's fingerprint,
a registration's pid and socket are checked before a worker is adopted, a take-over
whose successor went away leaves the running gym-proxy serving and ready for the next,
and a state file that cannot be believed is one line at start, never a hang. Real
processes: the running gym-proxy, its workers, and impostors forked as another user."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import socket
import tempfile
import types
from pathlib import Path

import aiohttp
import orjson
import pytest

from gym_proxy.coordinator.contract.framing import encode_frame, read_frame
from gym_proxy.coordinator.contract.lines import decode_line, encode_line
from gym_proxy.coordinator.contract.messages import Register
from gym_proxy.proxy.fleet.supervision.intent import INTENT_NAME
from gym_proxy.proxy.runtime_dir import IDENTITY_NAME, secret_fingerprint
from gym_proxy.proxy.take_over import (
    TAKE_OVER,
    TAKE_OVER_SOCKET,
    TAKE_OVER_VERSION,
    TakeOverAsk,
    TakeOverRefused,
)
from tests.support import TEST_SECRET, pid_alive, wait_until, wait_until_sync
from tests.test_proxy_adoption import GRACE, counts_and_pids, crash, seed

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="an impostor of another uid needs root")


def as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def impostor(parent: str, foreign: str) -> tuple[int, int]:
    """Fork a process that sets up a take-over socket for instance `apps` under
    `parent` and reports on a pipe what one connection sent it (nothing if none came).
    `foreign`: "directory", another user's directory; "listener", a directory and a
    socket file of this user's, listened on by another uid."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_end)
        return pid, read_end
    try:  # the child: nothing of the test's loop or its fixtures is used here
        os.close(read_end)
        if foreign == "directory":
            as_nobody()
        directory = Path(parent) / f"gym-proxy-{foreign[:8]}"
        directory.mkdir(mode=0o755 if foreign == "directory" else 0o700)
        identity = {"instance": "apps", "secret": "whatever"}
        (directory / IDENTITY_NAME).write_bytes(orjson.dumps(identity))
        if foreign == "directory":
            os.chmod(directory / IDENTITY_NAME, 0o644)
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(directory / TAKE_OVER_SOCKET))
        if foreign == "listener":
            as_nobody()  # the socket file is root's, its listener another user's
        listener.listen()
        if select.select([listener], [], [], 20)[0]:
            conn, _ = listener.accept()
            conn.settimeout(5)
            os.write(write_end, b"connected:")
            with contextlib.suppress(OSError):
                os.write(write_end, conn.recv(4096))
    finally:
        os._exit(0)


def report(pid: int, read_end: int) -> bytes:
    with os.fdopen(read_end, "rb") as pipe:
        got = pipe.read()
    os.waitpid(pid, 0)
    return got


@pytest.mark.parametrize("foreign", ["directory", "listener"])
def test_a_take_over_never_tells_another_user_anything(start_proxy, foreign):
    """Under a shared parent (mode 1777, as /tmp), another user's gym-proxy directory
    naming this instance, or a socket in a directory of this user's but listened on by
    another uid: `--take-over` sends neither anything, and refuses in one line."""
    shared = Path(tempfile.mkdtemp(prefix="gpt-", dir="/tmp"))  # removed with the proxy's
    os.chmod(shared, 0o1777)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    place = types.SimpleNamespace(
        runtime_parent=str(shared), listener=listener, port=listener.getsockname()[1]
    )
    pid, read_end = impostor(str(shared), foreign)
    wait_until_sync(lambda: any(shared.glob(f"gym-proxy-*/{TAKE_OVER_SOCKET}")), 10, "the impostor")
    new = start_proxy(*GRACE, "--take-over", workers=1, same_as=place, inherit=False, ready=False)
    try:
        assert new.wait_exit(60) == 2, new.log()
    finally:
        os.kill(pid, signal.SIGKILL)  # its wait ends now; what it got is in the pipe
        listener.close()
    got = report(pid, read_end)
    assert b"secret" not in got, got  # nothing derived from the secret reached it
    if foreign == "directory":
        assert "1 directories of other users skipped" in new.log(), new.log()
    else:
        line = f"runs as uid {NOBODY}, not as this user (uid 0)"
        assert line in new.log(), new.log()


async def test_a_registration_the_kernel_contradicts_is_not_adopted(start_proxy, http):
    """While a restarted gym-proxy adopts the dead one's workers, a process of the same
    user registers on its coordinator socket as a rejoining worker, naming another pid
    (a `sleep`) and a socket outside the runtime directory: it is dropped with one line,
    never adopted, and the `sleep` is not signalled when gym-proxy stops."""
    first = start_proxy(*GRACE, workers=1)
    sessions = await seed(http, first.url, 3)
    pids = crash(first)
    coordinator = str(first.runtime_dir() / "coordinator.sock")
    decoy = await asyncio.create_subprocess_exec("sleep", "300")
    claim = Register(
        slot=1,
        owner="impostor",
        pid=decoy.pid,
        socket="/tmp/not-a-worker.sock",
        kind="resources",
        framework="aiohttp",
        app_cookie=None,
        restart_only=False,
        rejoining=True,
    )
    frame = encode_frame({**claim.fields(), "type": Register.TYPE, "id": 1})
    answers: list[dict | None] = []

    async def register_until_answered() -> None:
        """Register as soon as the new proxy listens, again while it answers that it
        adopts nothing yet; the last answer (None: dropped unanswered)."""
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(coordinator)
            except OSError:
                await asyncio.sleep(0.02)  # the new proxy has not bound it yet
                continue
            writer.write(frame)
            try:
                answer = await read_frame(reader)
            except (ConnectionError, asyncio.IncompleteReadError):
                answer = None
            writer.close()
            answers.append(answer)
            if answer is not None and "only while it starts" in str(answer.get("detail")):
                continue  # too early: the adoption has not begun
            return

    trying = asyncio.ensure_future(asyncio.wait_for(register_until_answered(), 60))
    second = start_proxy(*GRACE, workers=1, same_as=first, ready=False)
    try:
        await trying
        await wait_until(lambda: "ready on http://" in second.log(), 60, "the restart")
        assert answers[-1] is None, answers  # dropped, not adopted (an ok would be a dict)
        line = f"a registration claims pid {decoy.pid}, but pid {os.getpid()} sent it"
        assert line in second.log(), second.log()
        assert "adopted 1 worker of the dead instance" in second.log(), second.log()
        async with aiohttp.ClientSession() as again:
            counts, answered = await counts_and_pids(again, second.url, sessions)
        assert counts == [1, 2, 3] and answered == set(pids)
        second.signal(signal.SIGTERM)
        assert second.wait_exit() == 0
        assert decoy.returncode is None and pid_alive(decoy.pid)  # never signalled
    finally:
        decoy.kill()
        await decoy.wait()


def take_over_socket(proxy) -> str:
    return str(proxy.runtime_dir() / TAKE_OVER_SOCKET)


def ask_for_the_port(proxy, version: int = TAKE_OVER_VERSION) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(take_over_socket(proxy))
    fingerprint = secret_fingerprint(TEST_SECRET.encode(), "apps")
    conn.sendall(encode_line(TakeOverAsk(version, fingerprint)))
    return conn


async def test_a_successor_that_goes_away_leaves_the_proxy_serving(start_proxy):
    """A `--take-over` that goes away after its request (Ctrl-C), and one that goes away
    after it received the port but before it said so (an OOM kill): each time the running
    gym-proxy says so in one line and goes on serving, and a real take-over after them
    succeeds."""
    first = start_proxy(*GRACE, workers=1)
    # Every connection closed at once: an idle keep-alive one would keep the old proxy
    # (which leaves it to its client) until its graceful timeout after the take-over.
    async with aiohttp.ClientSession() as seeding:
        sessions = await seed(seeding, first.url, 2)
    other = ask_for_the_port(first, version=TAKE_OVER_VERSION + 1)  # another version
    other.settimeout(10)
    refusal = decode_line(other.recv(4096), TAKE_OVER, "the running gym-proxy")
    other.close()
    assert isinstance(refusal, TakeOverRefused), refusal
    assert f"speaks take-over protocol {TAKE_OVER_VERSION + 1}, this one" in refusal.error
    ask_for_the_port(first).close()  # gone before the answer
    conn = ask_for_the_port(first)  # gone after the answer, before saying it took the port
    conn.settimeout(10)
    _, fds, _, _ = socket.recv_fds(conn, 4096, 1)
    assert fds, "the running gym-proxy sent no socket"
    for fd in fds:
        os.close(fd)
    conn.close()
    await wait_until(lambda: first.log().count("a take-over did not happen") == 2, 15, "both said")
    assert "Traceback" not in first.log(), first.log()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as fresh:
        counts, _ = await counts_and_pids(fresh, first.url, sessions)
    assert counts == [1, 2]
    first.listener.close()  # only the proxies hold the port now
    second = start_proxy(*GRACE, "--take-over", workers=1, same_as=first, inherit=False)
    assert "adopted 1 worker the previous instance passed on" in second.log(), second.log()
    assert first.wait_exit(30) == 0
    async with aiohttp.ClientSession() as again:
        counts, _ = await counts_and_pids(again, second.url, sessions)
    assert counts == [2, 3]


@pytest.mark.parametrize(
    ("name", "content", "line"),
    [
        (INTENT_NAME, "fifo", "fleet.json is not a regular file: the command line's worker"),
        (INTENT_NAME, b'{"workers": 100000, "drained": []}', "names 100000 workers, not 1-256"),
        (IDENTITY_NAME, "fifo", "instance.json is not a regular file, so nothing says they"),
        (IDENTITY_NAME, None, "instance.json is missing, so nothing says they serve this"),
        (IDENTITY_NAME, b'{"instance": "ap', "instance.json is not JSON"),
    ],
    ids=["fleet-fifo", "fleet-100000", "identity-fifo", "identity-missing", "identity-cut"],
)
async def test_a_state_file_not_to_believe_is_one_line_at_start(
    start_proxy, http, name, content, line
):
    """After a crash, a state file in the runtime directory is a FIFO, names 100000
    workers, is missing or cut short: the same command starts again at once and says
    so in one line. Without the fleet's intent the workers are adopted with the command
    line's count; without an identity to believe, nothing says the waiting workers serve
    this secret's tokens, so they are not adopted, and they stop."""
    first = start_proxy(*GRACE, workers=1)
    sessions = await seed(http, first.url, 2)
    pids = crash(first)
    path = first.runtime_dir() / name
    path.unlink(missing_ok=True)
    if content == "fifo":
        os.mkfifo(path)
    elif content is not None:
        path.write_bytes(content)
    second = start_proxy(*GRACE, workers=1, same_as=first, ready=False).wait_ready(60)
    said = [text for text in second.log().splitlines() if line in text]
    assert len(said) == 1, second.log()
    async with aiohttp.ClientSession() as again:
        if name == INTENT_NAME:
            assert "adopted 1 worker of the dead instance" in second.log()
            counts, answered = await counts_and_pids(again, second.url, sessions)
            assert counts == [1, 2] and answered == set(pids)
        else:
            assert "they stop with their sessions" in said[0]
            wait_until_sync(lambda: not any(map(pid_alive, pids)), 20, "the workers to stop")
            token = sessions[0][0]
            headers = {"X-NeMo-Gym-Session-Token": token}
            async with again.get(f"{second.url}/whoami", headers=headers) as resp:
                assert resp.status == 410, await resp.text()

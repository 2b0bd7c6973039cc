"""`--preload` (worker.zygote, proxy.fleet.supervision.zygote_client), with real processes: workers
are forked from one process that imported the app, are watched and replaced as spawned
ones are, and a zygote that dies or cannot fork safely is handled and said."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from gym_proxy.coordinator.contract.lines import decode_line, encode_line
from gym_proxy.coordinator.contract.zygote_lines import (
    ZYGOTE,
    ChildExited,
    Fork,
    Forked,
    ForkRefused,
)
from tests.support import (
    CONTROL_TOKEN,
    children_of,
    is_zygote,
    pid_alive,
    wait_until,
    wait_until_sync,
)

TOKEN = "X-NeMo-Gym-Session-Token"
OWNER = "x-ng-session-owner"


async def whoami(http, url, owner=None):
    headers = {OWNER: owner} if owner else {}
    async with http.get(f"{url}/whoami", headers=headers) as resp:
        assert resp.status == 200
        return await resp.json()


async def test_workers_are_forked_from_the_zygote_and_replaced_from_it(start_proxy, http):
    proxy = start_proxy("--preload", workers=2, control_token=CONTROL_TOKEN)
    [zygote] = [p for p in children_of(proxy.pid) if is_zygote(p)]
    workers = proxy.worker_pids()
    assert len(workers) == 2 and set(children_of(zygote)) == set(workers)
    async with http.post(f"{proxy.url}/seed_session", json={"initial_count": 7}) as resp:
        token = resp.headers[TOKEN]
    async with http.post(
        f"{proxy.url}/increment_counter", json={"count": 1}, headers={TOKEN: token}
    ) as resp:
        assert (await resp.json())["count"] == 8
    victim = workers[0]
    os.kill(victim, signal.SIGKILL)
    wait_until_sync(
        lambda: len(proxy.worker_pids()) == 2 and victim not in proxy.worker_pids(),
        20,
        "the killed worker to be replaced",
    )
    assert "exited with code -9; restarting" in proxy.log()
    assert set(children_of(zygote)) == set(proxy.worker_pids())  # from the same zygote
    for owner in {w["owner"] for w in (await status_workers(http, proxy))}:
        assert (await whoami(http, proxy.url, owner))["pid"] in proxy.worker_pids()
    proxy.signal(signal.SIGTERM)
    assert proxy.wait_exit(30) == 0
    wait_until_sync(lambda: not pid_alive(zygote), 10, "the zygote to exit with the proxy")


async def status_workers(http, proxy):
    async with http.get(
        f"{proxy.url}/ng-control/v1/checkpoint/status",
        headers={"Authorization": f"Bearer {CONTROL_TOKEN}"},
    ) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["workers"]


async def test_a_dead_zygote_takes_its_workers_and_a_new_one_forks_their_replacements(
    start_proxy, http
):
    proxy = start_proxy("--preload", workers=2, control_token=CONTROL_TOKEN)
    [zygote] = [p for p in children_of(proxy.pid) if is_zygote(p)]
    before = set(proxy.worker_pids())
    os.kill(zygote, signal.SIGKILL)

    async def replaced() -> bool:  # both registered again, under new pids
        now = {w["pid"] for w in await status_workers(http, proxy)}
        return len(now) == 2 and not now & before and now == set(proxy.worker_pids())

    await wait_until(replaced, 30, "both workers replaced through a new zygote")
    assert not any(pid_alive(p) for p in before)
    assert "the zygote exited; killing its 2 workers (they are replaced)" in proxy.log()
    [again] = [p for p in children_of(proxy.pid) if is_zygote(p)]
    assert again != zygote
    assert (await whoami(http, proxy.url))["pid"] in proxy.worker_pids()


def test_an_app_that_starts_a_thread_at_import_is_refused_in_one_line(start_proxy, tmp_path):
    (tmp_path / "threaded_app.py").write_text(
        "import threading, time\n"
        "from gym_proxy.worker.counter import create_app\n"
        "threading.Thread(target=time.sleep, args=(3600,), name='poller', daemon=True).start()\n"
    )
    started = time.monotonic()
    proxy = start_proxy(
        "--preload", "--app-dir", str(tmp_path), workers=1, app="threaded_app:create_app",
        ready=False,
    )  # fmt: skip
    assert proxy.wait_exit(60) == 3
    line = (
        "--preload cannot fork a worker: importing threaded_app:create_app started 1 "
        "threads (MainThread, poller); fork is unsafe"
    )
    assert line in proxy.log(), proxy.log()
    assert time.monotonic() - started < 60


@pytest.mark.fast
def test_the_zygote_forks_with_a_passed_descriptor_and_refuses_a_fork_without_the_one_it_names():
    """A Ray node's zygote gets each worker's bound socket with its fork (SCM_RIGHTS):
    `{fd}` in the argv becomes the descriptor's number in the worker. A fork that says
    it carries one and comes without is refused in one line, and the zygote serves on."""
    ours, theirs = socket.socketpair()
    zygote = subprocess.Popen(
        [sys.executable, "-P", "-m", "gym_proxy.worker.zygote", str(theirs.fileno()),
         "gym_proxy.worker.counter:create_app", ".", "8190", "32768"],
        pass_fds=(theirs.fileno(),), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    theirs.close()
    lines = ours.makefile("rb")
    try:
        ours.sendall(encode_line(Fork(["--socket=fd:{fd}"], {}, True)))
        refused = decode_line(lines.readline(), ZYGOTE, "the zygote")
        assert refused == ForkRefused("fork: fd is true but no descriptor came with the line")
        passed = socket.socket()  # the worker's port, as a node's zygote actor binds it
        # A slot that is no number: the worker's argparse says what it got, and exits 2.
        fork = Fork(["--socket=fd:{fd}", "--slot=x{fd}"], {}, True)
        socket.send_fds(ours, [encode_line(fork)], [passed.fileno()])
        forked = decode_line(lines.readline(), ZYGOTE, "the zygote")
        assert isinstance(forked, Forked)
        assert decode_line(lines.readline(), ZYGOTE, "the zygote") == ChildExited(forked.pid, 2)
        passed.close()
    finally:
        ours.close()
        lines.close()
        _, err = zygote.communicate(timeout=30)
    assert re.search(r"argument --slot: invalid int value: 'x\d+'", err), err

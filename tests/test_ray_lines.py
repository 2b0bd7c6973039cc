"""The lines of gym-proxy's two Ray processes (`proxy/ray_cluster/lines.py`), read strictly
at both ends: a line that is not JSON, names no type or one its protocol does not have,
or has an unknown, missing or mistyped key is refused in one line naming the peer.

Each end is the real code. Where the other end would need Ray (a cluster, a driver that
joined one), it is a stand-in process built from the real module's parts: the head's
holder logic on its take-over socket, or a driver that reads its requests with the real
`placement.requests` and answers in the protocol's messages. Ray itself is the NeMo Gym
tier's (`tests/test_nemo_gym_ray*.py`)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gym_proxy.coordinator.contract.exit_codes import FAILED
from gym_proxy.coordinator.contract.lines import LineError, encode_line, expect
from gym_proxy.proxy.fleet.supervision.launchers import Launch
from gym_proxy.proxy.fleet.supervision.worker_records import PlacedHandle, WorkerProcess
from gym_proxy.proxy.ray_cluster.cluster import RayCluster, RayPlan
from gym_proxy.proxy.ray_cluster.errors import RayError
from gym_proxy.proxy.ray_cluster.lines import (
    DRIVER,
    HEAD,
    LAUNCHER,
    PLACEMENT,
    ClusterAddress,
    DriverFailed,
    FollowWorker,
    KillWorker,
    PlacementSpec,
    SignalWorker,
    Spawn,
    WorkerStarted,
)
from gym_proxy.proxy.ray_cluster.placement import most_room, requests, room_for
from gym_proxy.proxy.ray_cluster.remote_workers import RayLauncher, RemoteWorker
from tests.support import REPO, wait_until

pytestmark = pytest.mark.fast

SPEC = PlacementSpec(2, 1.0, {"sandbox": 1.0}, "SPREAD", "apps", "")
PYTHON = (sys.executable, "-P")  # as gym-proxy starts its Ray processes


async def _never_called(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    raise AssertionError("no channel was to be dialed")


# ---- the Ray head holder --------------------------------------------------------------------
# A cluster left waiting for the next gym-proxy, as `head start KEEP_FOR SOCKET` leaves it,
# without Ray: it says LINE to the holder that connects, then follows the holder with the
# head's own `_Holder`, and exits 0 on its `stop`, 3 when it left without one.
WAITING_HEAD = """
import sys
from gym_proxy.proxy.ray_cluster.head import _Holder, _listen, _next_holder
listener = _listen(sys.argv[1])
print("listening", flush=True)
holder = _Holder()
conn = _next_holder(listener, 30, holder)
conn.sendall(sys.argv[2].encode())
holder.follow(conn.makefile("rb").readline)
sys.exit(3 if holder.wait() else 0)
"""


async def _waiting_head(socket_path: Path, line: bytes) -> asyncio.subprocess.Process:
    head = await asyncio.create_subprocess_exec(
        *PYTHON, "-c", WAITING_HEAD, str(socket_path), line.decode(),
        stdout=asyncio.subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    assert head.stdout is not None
    assert await asyncio.wait_for(head.stdout.readline(), 30) == b"listening\n"
    return head


async def test_a_waiting_cluster_is_taken_over_and_stopped_in_the_head_s_lines(short_tmp):
    """The successor reads the head's `cluster`, says `stopping` then `stop`, which the
    head's holder logic reads as its own (it exits 0: stopped, not left)."""
    socket_path = short_tmp / "ray-head.sock"
    head = await _waiting_head(socket_path, encode_line(ClusterAddress("10.0.0.1:6379", "token")))
    cluster = RayCluster(RayPlan(None), keep_for=5, socket_path=str(socket_path))
    await cluster.start()
    assert (cluster.address, cluster.environment) == ("10.0.0.1:6379", {"RAY_AUTH_MODE": "token"})
    cluster.stopping()
    await cluster.stop()
    assert await asyncio.wait_for(head.wait(), 30) == 0


@pytest.mark.parametrize(
    ("line", "why"),
    [
        # The line of before this protocol: an untyped object.
        (b'{"address": "10.0.0.1:6379", "auth_mode": null}\n', "sent a line with no message type"),
        (b"10.0.0.1:6379\n", "sent a line that is not JSON"),
        (b'{"type": "cluster", "address": "10.0.0.1:6379"}\n', "cluster: missing key(s) auth_mode"),
        (
            b'{"type": "cluster", "address": "h:1", "auth_mode": null, "nodes": 2}\n',
            "cluster: unknown key(s) nodes",
        ),
        (b'{"type": "cluster", "address": 6379, "auth_mode": null}\n', "address is not a str"),
        (b'{"type": "error", "error": "no"}\n', "sent 'error' where cluster was due"),
    ],
)
async def test_a_waiting_cluster_that_says_what_its_successor_cannot_read_is_not_taken(
    short_tmp, caplog, line, why
):
    """Refused in one log line naming the head; the head, left without `stop`, waits on
    for another holder (it exits 3 here)."""
    socket_path = short_tmp / "ray-head.sock"
    head = await _waiting_head(socket_path, line)
    cluster = RayCluster(RayPlan(None), keep_for=5, socket_path=str(socket_path))
    with caplog.at_level(logging.WARNING, "gym_proxy.ray"):
        assert await cluster._take_waiting() is None
    assert await asyncio.wait_for(head.wait(), 30) == 3
    (refusal,) = [r.getMessage() for r in caplog.records if r.name == "gym_proxy.ray"]
    assert refusal.startswith(f"Ray: the dead instance's cluster cannot be taken over ({HEAD} ")
    assert why in refusal and "\n" not in refusal


async def test_a_named_cluster_that_cannot_be_joined_is_the_head_s_error_line():
    """The real `head check` (it fails before it imports Ray) says `error`; the proxy
    reads it as one line for the user, naming what named the cluster."""
    cluster = RayCluster(RayPlan("not-an-address", "RAY_ADDRESS"))
    with pytest.raises(RayError) as refused:
        await cluster.start()
    assert str(refused.value) == (
        "the Ray address 'not-an-address' is not HOST:PORT (named by RAY_ADDRESS)"
    )


# ---- the placement driver ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ('{"workers": 2, "cpus": 1}', "sent a line with no message type"),
        (
            '{"type": "spec", "workers": 2, "cpus": 1, "resources": {}, "strategy": "SPREAD", '
            '"instance": "apps"}',
            "spec: missing key(s) runtime_dir",
        ),
        (
            encode_line(SPEC).decode().replace('"workers":2', '"workers":"2"'),
            "spec: workers is not a int",
        ),
    ],
)
def test_the_driver_refuses_a_spec_it_cannot_read_in_its_failed_line(spec, why):
    """Before it joins any cluster: one `failed` line naming the launcher, exit 1."""
    driver = subprocess.run(
        [*PYTHON, "-m", "gym_proxy.proxy.ray_cluster.placement", "127.0.0.1:1", spec],
        capture_output=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert driver.returncode == FAILED, driver.stderr
    failed = expect(driver.stdout, PLACEMENT, DRIVER, DriverFailed)
    assert failed.error.startswith(f"{LAUNCHER}, in SPEC, sent ") and why in failed.error


def test_the_driver_reads_the_launcher_s_requests_and_refuses_what_it_cannot():
    sent = [
        Spawn(1, ["--slot=0"], {"A": "b"}, "/srv"),
        FollowWorker(2, "apps-0a1b2c3d-2"),
        SignalWorker(1, 15),
        KillWorker(1),
    ]
    assert list(requests(encode_line(request) for request in sent)) == sent
    for line, why in [
        (b'{"op": "spawn", "id": 1}\n', "sent a line with no message type"),
        (b'{"type": "kill"}\n', "kill: missing key(s) key"),
        (b'{"type": "kill", "key": "1"}\n', "kill: key is not a int"),
        (b'{"type": "signal", "key": 1, "signal": 15, "why": "x"}\n', "unknown key(s) why"),
        # `id` is the channel's envelope, which the messages' decode leaves out: not a line's
        (b'{"type": "kill", "key": 1, "id": 1}\n', "kill: unknown key(s) id"),
        (b'{"type": "exit", "key": 1}\n', "sent a 'exit' message, which this protocol does not"),
        (encode_line(WorkerStarted(1, "a", 2, "h", 3, "", "n", "x")), "sent 'started' where spawn"),
    ]:
        with pytest.raises(LineError) as refused:
            list(requests([encode_line(KillWorker(1)), line]))
        assert str(refused.value).startswith(f"{LAUNCHER} sent ") and why in str(refused.value)


# A placement driver without Ray: it reads its SPEC, says ready, and answers each request
# it reads (with the real `placement.requests`) with a line that is no message, then
# `not_started` naming what it read.
STAND_IN_DRIVER = """
import sys
from gym_proxy.coordinator.contract.lines import encode_line, expect
from gym_proxy.proxy.ray_cluster.lines import PLACEMENT, DriverReady, NotStarted, PlacementSpec
from gym_proxy.proxy.ray_cluster.placement import requests
spec = expect(sys.argv[2].encode(), PLACEMENT, "the launcher", PlacementSpec)
out = sys.stdout.buffer
out.write(encode_line(DriverReady(1, spec.workers)))
out.flush()
for request in requests(sys.stdin.buffer):
    out.write(b'{"id": 1, "started": {}}\\n')
    why = f"stand-in: {request.TYPE} {request.argv} in {request.cwd}"
    out.write(encode_line(NotStarted(request.key, why)))
    out.flush()
"""


async def test_the_launcher_and_a_driver_speak_the_protocol_and_refuse_what_they_cannot_read(
    caplog,
):
    """The driver decodes the launcher's SPEC and `spawn` strictly; the launcher refuses
    the driver's line that is no message (one log line naming the driver, nothing acts
    on it) and takes its `not_started` as the spawn's failure."""
    launcher = RayLauncher(SPEC, b"k" * 32, driver=(*PYTHON, "-c", STAND_IN_DRIVER))
    await launcher.open(Launch({}, "127.0.0.1:1", _never_called))
    try:
        with caplog.at_level(logging.ERROR, "gym_proxy.supervisor"):
            with pytest.raises(OSError) as failed:
                await asyncio.wait_for(launcher.spawn(["--slot=0", "--socket=/x"]), 30)
        assert str(failed.value) == f"stand-in: spawn ['--slot=0'] in {os.getcwd()}"
        (refusal,) = [r.getMessage() for r in caplog.records if r.name == "gym_proxy.supervisor"]
        assert refusal == (
            f'{DRIVER} sent a line with no message type: b\'{{"id": 1, "started": {{}}}}\\n\'; '
            "ignored"
        )
    finally:
        await launcher.close()


# Answers each spawn with a worker whose Unix socket is outside the runtime directory,
# and writes each kill it is asked for to the file GYM_TEST_KILLS names.
OUTSIDE_DRIVER = """
import os, sys
from gym_proxy.coordinator.contract.lines import encode_line, expect
from gym_proxy.proxy.ray_cluster.lines import (
    PLACEMENT, DriverReady, KillWorker, PlacementSpec, Spawn, WorkerStarted,
)
from gym_proxy.proxy.ray_cluster.placement import requests
spec = expect(sys.argv[2].encode(), PLACEMENT, "the launcher", PlacementSpec)
out = sys.stdout.buffer
out.write(encode_line(DriverReady(1, spec.workers)))
out.flush()
for request in requests(sys.stdin.buffer):
    if isinstance(request, Spawn):
        said = WorkerStarted(request.key, "a", 1, "h", 0, "/elsewhere/placed-1.sock", "n", "h")
        out.write(encode_line(said))
        out.flush()
    elif isinstance(request, KillWorker):
        with open(os.environ["GYM_TEST_KILLS"], "a") as kills:
            kills.write(f"{request.key}\\n")
"""


async def test_a_unix_socket_outside_the_runtime_directory_is_refused_and_its_worker_killed(
    short_tmp,
):
    """Only gym-proxy's own runtime directory is private to it: a worker said to listen
    anywhere else is not dialed; its actor is killed and the spawn fails in one line."""
    kills = short_tmp / "kills"
    spec = PlacementSpec(1, 1.0, {}, "SPREAD", "apps", str(short_tmp))
    launcher = RayLauncher(spec, b"k" * 32, driver=(*PYTHON, "-c", OUTSIDE_DRIVER))
    await launcher.open(Launch({"GYM_TEST_KILLS": str(kills)}, "127.0.0.1:1", _never_called))
    try:
        with pytest.raises(OSError, match=f"reported a socket outside {short_tmp}$"):
            await asyncio.wait_for(launcher.spawn(["--slot=0"]), 30)
        await wait_until(lambda: kills.exists() and kills.read_text() == "1\n", 10, "the kill")
    finally:
        await launcher.close()


# Leaves every spawn pending (an actor that does not fit yet: Ray's autoscaler has not
# added its node), and writes each spawn and kill it is asked for to GYM_TEST_KILLS.
PENDING_DRIVER = """
import os, sys
from gym_proxy.coordinator.contract.lines import encode_line, expect
from gym_proxy.proxy.ray_cluster.lines import PLACEMENT, DriverReady, PlacementSpec
from gym_proxy.proxy.ray_cluster.placement import requests
spec = expect(sys.argv[2].encode(), PLACEMENT, "the launcher", PlacementSpec)
sys.stdout.buffer.write(encode_line(DriverReady(1, 0)))
sys.stdout.buffer.flush()
for request in requests(sys.stdin.buffer):
    with open(os.environ["GYM_TEST_KILLS"], "a") as kills:
        kills.write(f"{request.TYPE} {request.key}\\n")
"""


async def test_a_worker_that_finds_no_room_waits_placement_wait_then_its_actor_is_killed(
    short_tmp, caplog
):
    """A worker that does not fit yet waits for the cluster to grow, `--placement-wait`
    at most (said once it has waited): then the spawn fails naming what it needed and
    the wait, and its pending actor is killed, so that a node added later starts nothing.
    A spawn cancelled while it waits (an autoscale grow giving way) kills it too."""
    kills = short_tmp / "kills"
    launcher = RayLauncher(SPEC, b"k" * 32, driver=(*PYTHON, "-c", PENDING_DRIVER),
                           placement_wait=0.5)  # fmt: skip
    await launcher.open(Launch({"GYM_TEST_KILLS": str(kills)}, "127.0.0.1:1", _never_called))
    try:
        with caplog.at_level(logging.WARNING, "gym_proxy.supervisor"):
            with pytest.raises(OSError) as failed:
                await asyncio.wait_for(launcher.spawn(["--slot=0"]), 30)
        assert str(failed.value) == (
            "no room on the Ray cluster for a worker of {CPU 1, sandbox 1} within 0.5 s "
            "(--placement-wait): the cluster did not grow"
        )
        assert "a worker of {CPU 1, sandbox 1} waits for room on the Ray cluster" in caplog.text
        asked = ["spawn 1", "kill 1"]
        await wait_until(lambda: kills.read_text().splitlines() == asked, 10, "the kill")
        spawn = asyncio.ensure_future(launcher.spawn(["--slot=1"]))
        asked.append("spawn 2")
        await wait_until(lambda: kills.read_text().splitlines() == asked, 10, "the spawn")
        spawn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await spawn
        asked.append("kill 2")
        await wait_until(lambda: kills.read_text().splitlines() == asked, 10, "the second kill")
    finally:
        await launcher.close()


@pytest.mark.parametrize(
    ("bound", "room"),
    [(None, -1), ({}, -1), ({"CPU": 7.0, "sandbox": 2.0}, 2), ({"CPU": 7.0}, 0),
     ({"CPU": 0.5, "sandbox": 9.0}, 0)],
)  # fmt: skip
def test_the_room_the_cluster_may_grow_to_is_its_reported_bound_s(bound, room):
    """What Ray's autoscaler reports it may grow the cluster to (v2, KubeRay), in workers
    of {CPU 1, sandbox 1}; -1 when it reports none (v1, a fixed cluster)."""
    assert most_room(bound, {"CPU": 1.0, "sandbox": 1.0}) == room


@pytest.mark.parametrize(
    ("cpus", "each", "room"), [(1.0, 0.1, 10), (3.0, 0.3, 10), (1.0, 0.7, 1), (2.0, 0.5, 4)]
)
def test_room_is_counted_in_ray_s_fixed_point_not_floats(cpus, each, room):
    """1.0 // 0.1 is 9 in floats; Ray places 10 actors of 0.1 CPU on one CPU."""
    node = {"Alive": True, "Resources": {"CPU": cpus}}
    assert room_for([node], {"CPU": each}) == room
    assert most_room({"CPU": cpus}, {"CPU": each}) == room


@pytest.mark.parametrize(
    ("said", "why"),
    [
        ("", "the Ray placement driver ended before it said anything (its log is above)"),
        (encode_line(DriverFailed("no room")).decode(), "no room"),
        ('{"ready": {"nodes": 1, "room": 2}}\n', f"{DRIVER} sent a line with no message type"),
        ('{"type": "ready", "nodes": 1}\n', "ready: missing key(s) room"),
    ],
)
async def test_a_driver_that_is_not_ready_is_one_line_for_the_user(said, why):
    script = f"import sys; sys.stdout.write({said!r}); sys.stdout.flush()"
    launcher = RayLauncher(SPEC, b"k" * 32, driver=(*PYTHON, "-c", script))
    with pytest.raises(RayError) as refused:
        await launcher.open(Launch({}, "127.0.0.1:1", _never_called))
    assert why in str(refused.value) and "\n" not in str(refused.value)


# ---- the boundary: the fleet knows placed workers by its own protocol ---------------------
async def test_a_placed_worker_is_a_placed_handle_to_the_fleet_and_a_local_one_is_not():
    launcher = RayLauncher(SPEC, b"k" * 32)
    started = WorkerStarted(1, "a", 7, "10.0.0.2", 9, "", "node-a", "h")
    handle: PlacedHandle = RemoteWorker(launcher, started)
    placed = WorkerProcess(0, "owner", "", handle, 0.0)
    assert isinstance(handle, PlacedHandle) and (placed.node, placed.local) == ("node-a", False)
    process = await asyncio.create_subprocess_exec("true")
    try:
        local = WorkerProcess(1, "other", "/run/w1.sock", process, 0.0)
        assert not isinstance(process, PlacedHandle) and (local.node, local.local) == ("", True)
    finally:
        await process.wait()

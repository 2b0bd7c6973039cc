"""The supervisor in the test's own event loop: the real Supervisor, WorkerChannels and
Router, with stand-in worker processes (STANDIN) instead of the real app.

A stand-in registers over a real coordinator Channel and serves it (its reader answers
pings) until the channel ends. `--mode` makes the first incarnation to claim the marker
file misbehave (it writes "<slot> <owner>" there); every later one serves.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gym_proxy.coordinator.contract.channel import Channel
from gym_proxy.coordinator.contract.messages import Register, RegisterReply, Tables
from gym_proxy.coordinator.worker_channels import RegistrationRefused, WorkerChannels
from gym_proxy.proxy.config import Config
from gym_proxy.proxy.data_path.routing import Router
from gym_proxy.proxy.fleet.supervision.intent import KeptIntent
from gym_proxy.proxy.fleet.supervision.launchers import Launch, SubprocessLauncher
from gym_proxy.proxy.fleet.supervision.liveness import watch_liveness
from gym_proxy.proxy.fleet.supervision.supervisor import (
    TEST_OWNERS_ENV,
    Supervisor,
    WorkerBootError,
    WorkerProcess,
)

OWNERS = ("owner-a", "owner-b", "owner-c", "owner-d", "owner-e", "owner-f")
APP = "standin.app:create_app"

STANDIN = """
import asyncio, os, signal, sys
from gym_proxy.coordinator.contract.channel import Channel
from gym_proxy.coordinator.contract.exit_codes import BOOT_ERROR
from gym_proxy.coordinator.contract.messages import Register

opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
mode, slot, owner = opts["mode"], int(opts["slot"]), opts["owner"]
odd = False
if mode.endswith("_all"):
    odd = True
elif mode != "serve":
    claim = f"{opts['marker']}.{os.getpid()}"
    with open(claim, "w") as f:
        f.write(f"{slot} {owner}")
    try:
        os.link(claim, opts["marker"])  # atomic: the marker appears with its content
        odd = True
    except FileExistsError:
        pass
    os.unlink(claim)
if odd and mode == "boot_error":
    sys.exit(BOOT_ERROR)
if odd and mode == "silent":
    while True:
        signal.pause()
if odd and mode.startswith("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

async def handle(message):
    return None

async def main():
    reader, writer = await asyncio.open_unix_connection(opts["coordinator"])
    channel = Channel(reader, writer, handle)
    serving = asyncio.ensure_future(channel.serve())
    registration = Register(slot, owner, os.getpid(), opts["socket"], kind="resources",
                            framework="aiohttp", app_cookie=None, restart_only=False)
    await channel.request(registration, within=10)
    if odd and mode == "crash":
        os._exit(1)
    if odd and mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    await serving
    writer.close()

asyncio.run(main())
"""


async def eventually(predicate: Callable[[], Any], what: str, within: float = 5.0) -> Any:
    """Poll `predicate` until it returns something truthy (returned); fail after `within` s."""
    deadline = time.monotonic() + within
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.01)
    return value


def reaped(process: asyncio.subprocess.Process) -> bool:
    """The process exited and was waited for (its pid is gone)."""
    if process.returncode is None:
        return False
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return True
    return False


class Rig:
    """A Supervisor wired to WorkerChannels as proxy/server.py wires them."""

    def __init__(self, tmp_path: Path, mode: str, command: tuple[str, ...] | None, **cfg: Any):
        self.marker = tmp_path / "marker"
        cfg = {"workers": 2, "worker_timeout": 1.0, "boot_timeout": 10.0, **cfg}
        self.config = Config(app=APP, **cfg)
        intent = KeptIntent(str(tmp_path), self.config.workers)
        self.router = Router(on_aliases=intent.aliases_changed)
        self.supervisor = Supervisor(
            self.config,
            str(tmp_path),
            str(tmp_path / "coordinator.sock"),
            self.router,
            intent,
            launcher=SubprocessLauncher(
                command
                or (sys.executable, "-c", STANDIN, f"--mode={mode}", f"--marker={self.marker}")
            ),
        )
        self.channels = WorkerChannels(self._on_register, self.supervisor.on_lost, self._on_message)
        self.liveness: asyncio.Task[None] | None = None

    def _on_register(self, registration: Register, channel: Channel) -> RegisterReply:
        self.supervisor.on_register(registration, channel)
        return RegisterReply(Tables({}, {}), None)

    async def _on_message(self, owner: str, message: Any) -> None:
        return None

    def worker(self, slot: int) -> WorkerProcess:
        worker = self.supervisor.slots[slot].worker
        assert worker is not None, f"slot {slot} has no worker"
        return worker

    def odd(self) -> tuple[int, str]:
        """The slot and owner of the stand-in that misbehaved."""
        slot, owner = self.marker.read_text().split()
        return int(slot), owner

    async def close(self) -> None:
        if self.liveness is not None:
            self.liveness.cancel()
            await asyncio.gather(self.liveness, return_exceptions=True)
        await self.supervisor.stop(0.2)
        for worker in self.supervisor.slots.workers():  # whatever stop() left behind
            if worker.process is not None and worker.process.returncode is None:
                worker.process.kill()
                await worker.process.wait()
        await self.channels.close()


@pytest.fixture
async def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`await rig(mode, **config)`: a listening Rig; every one is stopped and reaped after."""
    monkeypatch.setenv(TEST_OWNERS_ENV, ",".join(OWNERS))
    rigs: list[Rig] = []

    async def make(mode: str = "serve", command: tuple[str, ...] | None = None, **cfg: Any) -> Rig:
        made = Rig(tmp_path, mode, command, **cfg)
        rigs.append(made)
        await made.channels.start(str(tmp_path / "coordinator.sock"))
        await made.supervisor.launcher.open(Launch())  # as the server does, once booted
        return made

    yield make
    for made in rigs:
        await made.close()


async def test_start_returns_with_every_slot_registered_and_routed(rig):
    """start() returns only once every slot's worker registered; the router then has each
    worker under its owner with its slot and socket, and live() lists them by slot."""
    r = await rig()
    await r.supervisor.start()
    workers = [r.worker(0), r.worker(1)]
    assert [(w.slot, w.owner, w.state) for w in workers] == [
        (0, OWNERS[0], "live"),
        (1, OWNERS[1], "live"),
    ]
    assert set(r.router.workers) == {OWNERS[0], OWNERS[1]}
    for w in workers:
        route = r.router.workers[w.owner]
        assert route is w.route and route.slot == w.slot and route.responsive
        assert route.address == os.path.join(r.supervisor.runtime_dir, f"w{w.slot}-{w.owner}.sock")
    live = r.supervisor.live()
    assert [(lw.slot, lw.owner, lw.pid) for lw in live] == [
        (w.slot, w.owner, w.process.pid) for w in workers
    ]
    assert [lw.channel for lw in live] == [r.channels.channels[w.owner] for w in workers]


async def test_live_lists_only_registered_workers(rig):
    """A worker that is running but has not registered is not in live() nor routable."""
    r = await rig("silent")
    r.supervisor.reconcile()
    await eventually(lambda: len(r.supervisor.live()) == 1, "one worker to register")
    silent_slot, silent_owner = r.odd()
    silent = r.worker(silent_slot)
    assert silent.state == "starting" and silent.process.returncode is None
    [only] = r.supervisor.live()
    assert only.slot == 1 - silent_slot and only.owner == r.worker(1 - silent_slot).owner
    assert set(r.router.workers) == {only.owner}


async def test_start_gives_up_after_boot_timeout(rig):
    """A worker that never registers makes start() raise after boot_timeout."""
    r = await rig("silent", boot_timeout=0.5)
    began = time.monotonic()
    with pytest.raises(WorkerBootError, match="did not register within 0.5 s"):
        await r.supervisor.start()
    assert 0.45 <= time.monotonic() - began < 3


async def test_boot_error_makes_start_raise_naming_the_app(rig):
    """A worker exiting with BOOT_ERROR fails start() with WorkerBootError naming the slot
    and the app, and its slot is not respawned."""
    r = await rig("boot_error")
    with pytest.raises(WorkerBootError) as raised:
        await r.supervisor.start()
    slot, _ = r.odd()
    assert f"worker {slot} cannot build app {APP}" in str(raised.value)
    assert r.supervisor.slots[slot].worker is None
    assert {w.owner for w in r.supervisor.slots.workers()} <= set(OWNERS[:2])


async def test_unstartable_command_makes_start_raise(rig, tmp_path):
    """A worker command that cannot be executed fails start() at once."""
    r = await rig(command=(str(tmp_path / "no-such-program"),))
    with pytest.raises(WorkerBootError, match="cannot start a worker process"):
        await r.supervisor.start()


async def test_crashed_worker_is_unrouted_and_respawned_under_a_new_owner(rig):
    """A worker that exits after registering leaves the router and its slot gets a new
    incarnation with a fresh owner ID (after the first backoff step), which registers;
    the other slot is untouched."""
    r = await rig("crash")
    await r.supervisor.start()
    slot, crashed = r.odd()
    other = r.worker(1 - slot)
    await eventually(lambda: crashed not in r.router.workers, "the crashed worker to go")
    respawn = await eventually(
        lambda: (
            (w := r.supervisor.slots[slot].worker)
            and w.owner != crashed
            and w.state == "live"
            and w
        ),
        "the respawned worker to register",
    )
    assert respawn.owner == OWNERS[2]
    assert r.router.workers[respawn.owner].slot == slot
    assert set(r.router.workers) == {respawn.owner, other.owner}
    assert r.router.resolve_owner(crashed) is None  # its tokens answer 410 from now on
    assert r.worker(1 - slot) is other and other.process.returncode is None
    assert r.supervisor.slots[slot].failures == 1
    assert respawn.started_at >= r.supervisor.slots[slot].restart_at  # backoff honoured


async def test_unexpected_registration_is_refused(rig: Callable[..., Awaitable[Rig]]):
    """on_register refuses a slot that does not exist, an owner the slot does not expect
    and a second registration of a live worker, and changes nothing when it does."""
    r = await rig()
    await r.supervisor.start()
    before = dict(r.router.workers)
    channels = [r.worker(0).channel, r.worker(1).channel]

    def register(slot: int, owner: str) -> None:
        reg = Register(slot, owner, 1, "/nowhere.sock", "resources", "aiohttp", None, False)
        # No channel: each is refused before its channel is used.
        r.supervisor.on_register(reg, object())  # type: ignore[arg-type]

    for slot, owner in [
        (2, OWNERS[0]),
        (-1, OWNERS[0]),
        (0, "stranger"),
        (0, OWNERS[0]),
        (1, OWNERS[0]),
    ]:
        with pytest.raises(RegistrationRefused):
            register(slot, owner)
    assert r.router.workers == before
    assert [r.worker(0).channel, r.worker(1).channel] == channels


async def test_sigstopped_worker_is_first_unplaced_then_killed_and_replaced(rig):
    """A worker whose event loop stops (SIGSTOP) first gets no new sessions while it is
    still routed, then is SIGKILLed after worker_timeout and replaced by a new owner."""
    r = await rig("stop")
    await r.supervisor.start()
    r.liveness = asyncio.ensure_future(watch_liveness(r.supervisor))
    slot, stopped_owner = r.odd()
    stopped, other = r.worker(slot), r.worker(1 - slot)
    route = stopped.route
    await eventually(lambda: route.responsive is False, "the stopped worker to be unplaced")
    assert stopped.process.returncode is None and r.router.workers.get(stopped_owner) is route
    assert other.route.responsive
    respawn = await eventually(
        lambda: (
            (w := r.supervisor.slots[slot].worker) and w is not stopped and w.state == "live" and w
        ),
        "the stopped worker to be replaced",
    )
    assert stopped.process.returncode == -signal.SIGKILL
    assert stopped_owner not in r.router.workers and respawn.owner == OWNERS[2]
    assert r.router.workers[respawn.owner].responsive
    assert r.worker(1 - slot) is other and other.route.responsive


async def test_stop_sigkills_a_worker_that_ignores_sigterm_after_grace(rig):
    """stop(grace) SIGTERMs every worker, SIGKILLs the one still running at the deadline
    and reaps both; nothing is respawned."""
    r = await rig("ignore_term")
    await r.supervisor.start()
    slot, _ = r.odd()
    stubborn, polite = r.worker(slot), r.worker(1 - slot)
    began = time.monotonic()
    await r.supervisor.stop(0.5)
    assert 0.45 <= time.monotonic() - began < 3
    assert stubborn.process.returncode == -signal.SIGKILL
    assert polite.process.returncode == -signal.SIGTERM
    assert reaped(stubborn.process) and reaped(polite.process)
    assert all(w in (stubborn, polite) for w in r.supervisor.slots.workers())


async def test_stop_returns_as_soon_as_workers_exit(rig):
    """With no straggler, stop() does not wait out the grace period."""
    r = await rig()
    await r.supervisor.start()
    workers = r.supervisor.slots.workers()
    began = time.monotonic()
    await r.supervisor.stop(10.0)
    assert time.monotonic() - began < 3
    assert all(w.process.returncode == -signal.SIGTERM and reaped(w.process) for w in workers)


async def test_stop_reaps_a_worker_whose_spawn_was_in_flight(rig, monkeypatch):
    """A worker being respawned when stop() begins is stopped and reaped too."""
    r = await rig("ignore_term_all")  # stop() waits its whole grace for every worker
    await r.supervisor.start()
    gate = asyncio.Event()
    spawn = asyncio.create_subprocess_exec

    async def gated_spawn(*args: Any, **kwargs: Any) -> Any:
        await gate.wait()
        return await spawn(*args, **kwargs)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", gated_spawn)
    crashed = r.worker(1)
    crashed.process.kill()
    respawn = await eventually(
        lambda: (w := r.supervisor.slots[1].worker) and w is not crashed and w,
        "the respawn to start",
    )
    assert respawn.process is None  # reserved, not yet started
    stopping = asyncio.ensure_future(r.supervisor.stop(1.0))
    await eventually(lambda: r.supervisor.stopping, "stop() to begin")
    gate.set()
    await stopping
    # Never started, or started and reaped: either way no worker outlives stop().
    assert respawn.process is None or reaped(respawn.process), "the respawn outlived stop()"


async def test_no_worker_is_called_silent_before_its_first_ping(rig, caplog):
    """Workers that registered long before liveness began (the last one booted slowly on
    a busy machine) are not called unresponsive before they had a ping to answer."""
    r = await rig()
    await r.supervisor.start()
    workers = r.supervisor.slots.workers()
    for worker in workers:
        worker.answered_at -= 10.0  # registered 10 s ago, far past 2 ping intervals
    r.liveness = asyncio.ensure_future(watch_liveness(r.supervisor))
    await eventually(
        lambda: all(w.ping_seconds is not None for w in workers), "every worker to answer"
    )
    assert all(w.route.responsive for w in workers)
    assert "is not answering" not in caplog.text, caplog.text

"""Workers on the nodes of the server's Ray cluster (`--worker-placement ray`), as the
supervisor sees them: started by a `RayLauncher` (a
`proxy.fleet.supervision.launchers.WorkerLauncher`), each a `RemoteWorker` handle (a
`proxy.fleet.supervision.worker_records.PlacedHandle`). The fleet knows them only by those two
protocols of its own; this module is the Ray side of that boundary, beside its driver.

The launcher runs the Ray driver in a process of its own (`proxy.ray_cluster.placement`:
the proxy never imports Ray) and asks it for one actor per worker, in the driver's lines
(`proxy.ray_cluster.lines.PLACEMENT`; a line of the driver's it cannot read is refused
in one log line naming the driver). A worker it starts listens behind its gate
(`worker.link_gate`) on a TCP port of its node, or, on gym-proxy's own node, on a Unix
socket in gym-proxy's runtime directory (`proxy.ray_cluster.worker_host`); the launcher
dials its coordinator channel in (the proxy opens no port towards the cluster) and hands
it to the coordinator as if the worker had connected to the local socket, so it
registers as any worker does. Its data connections are dialed the same way
(`RemoteWorker.connect`, the route's connector), each proving the link key first
(`coordinator.contract.worker_link`).

A worker's exit comes from the driver: its process's status, or EXIT_UNKNOWN with the
reason when its actor died (its node gone). A channel that ends without an exit (a node
that dies takes its worker's sockets with it) gets the actor killed, so the slot is
reaped and started again on the nodes that remain, without waiting for Ray to notice.
The workers' actors outlive the driver (detached): a driver that dies is replaced by one
that follows them by name (`follow`), so a worker is never lost to its driver alone
(at most REPLACE_AT_MOST replacements in REPLACE_WINDOW seconds; past that, or when no
driver starts, every worker is taken as gone, in one line).

A worker is lost only when it is gone. A data connection refused at its port (nothing
listens there: its worker is gone, as its gate listens from the start to the end), or
answered by something that is not it, cuts its channel, so that its sessions answer 410
from the request that found it on (`WorkerGone`), whichever of the two ends the proxy
reads first. One that is not proved in time, or dropped before its proof (a worker whose
loop a handler blocks, a gate full of strangers' half-open connections), is dialed again
until it is: as for a local worker, only its pings (`--worker-timeout`) and its channel
say it is gone.

Stopping goes through no Ray call: SIGTERM is asked over the worker's link as well as
through the driver (whichever comes first stops it), and a worker told to stop closes its
channel last, after its app's shutdown, which is its exit here (on a loaded machine Ray's
report of it can come late: the driver ends the actor when it does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from asyncio import StreamReader, StreamWriter
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from gym_proxy.coordinator.contract.errors import WorkerGone
from gym_proxy.coordinator.contract.exit_codes import EXIT_UNKNOWN
from gym_proxy.coordinator.contract.framing import STREAM_LIMIT
from gym_proxy.coordinator.contract.lines import LineError, decode_line, encode_line, greeting
from gym_proxy.coordinator.contract.messages import Message
from gym_proxy.coordinator.contract.worker_link import (
    CHANNEL,
    DATA,
    LINK_KEY_ENV,
    LinkAddress,
    LinkRefused,
    LinkUnproven,
    connect,
    dial,
    stop_worker,
)
from gym_proxy.proxy.fleet.supervision.launchers import Launch
from gym_proxy.proxy.ray_cluster.errors import RayError
from gym_proxy.proxy.ray_cluster.lines import (
    DRIVER,
    PLACEMENT,
    DriverFailed,
    DriverReady,
    FindWorkers,
    FollowWorker,
    FoundWorkers,
    KillWorker,
    NotStarted,
    PlacementSpec,
    SignalWorker,
    Spawn,
    StopWorkers,
    WorkerExited,
    WorkerStarted,
)

if TYPE_CHECKING:
    from gym_proxy.proxy.data_path.upstream import UpstreamConnection

__all__ = ["RayLauncher", "RemoteWorker", "remote_environment"]

log = logging.getLogger("gym_proxy.supervisor")

START_WAIT = 120.0  # seconds for the driver to join the cluster and check its room
STOP_WAIT = 15.0  # seconds for the driver to kill the actors and leave
# A driver that dies is replaced at most this often; past it, its workers are gone.
REPLACE_AT_MOST = 3
REPLACE_WINDOW = 60.0
LOST_EXIT_WAIT = 2.0  # seconds a worker whose channel ended unasked has to exit
# `-P`: the user's working directory must not shadow the packages the driver imports.
DRIVER_COMMAND = (sys.executable, "-P", "-m", "gym_proxy.proxy.ray_cluster.placement")
# A worker's actor lost before it started the worker (its node died before Ray knew) is
# placed again this long: Ray takes up to ~30 s by default to declare a silent node dead.
PLACE_AGAIN_FOR = 60.0
PLACE_AGAIN_PAUSE = 1.0
PLACEMENT_WAIT = 300.0  # seconds a worker that does not fit yet waits for the cluster to grow
PENDING_SAY = 30.0  # after this, a worker still waiting for room is said (Ray Serve's 30 s)
# A link that did not prove itself is dialed again after this pause, doubled each time
# up to DIAL_AGAIN_MAX: at once would add to a flood at the worker's port.
DIAL_AGAIN_FIRST = 0.01
DIAL_AGAIN_MAX = 0.5
LOG_EVERY = 10.0  # seconds between a worker's log lines about links dialed again
# What describes the proxy's own machine, login or Ray's assignment of it, not the app:
# a remote worker keeps its node's values (Ray sets CUDA_VISIBLE_DEVICES per actor).
LOCAL_ONLY = frozenset(
    {"HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "SHLVL", "HOSTNAME", "TERM", "_",
     "PATH", "TMPDIR", "DISPLAY", "CUDA_VISIBLE_DEVICES", "VIRTUAL_ENV", "PYTHONHOME"}
)  # fmt: skip
LOCAL_PREFIXES = ("SSH_", "XDG_", "RAY_")
CARRIED_RAY = frozenset({"RAY_AUTH_MODE"})  # how the workers join: the proxy's, as locally


DRIVER_SAYS = (WorkerStarted, NotStarted, WorkerExited, FoundWorkers)  # after `ready`


class ActorLost(OSError):
    """The worker's actor died before it started the worker."""


def remote_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What a worker on a node gets of the proxy's environment: everything a local worker
    would inherit, but what describes the proxy's machine (LOCAL_ONLY, LOCAL_PREFIXES)."""
    return {
        name: value
        for name, value in environ.items()
        if name in CARRIED_RAY or not (name in LOCAL_ONLY or name.startswith(LOCAL_PREFIXES))
    }


class RemoteWorker:
    """A `PlacedHandle` for a worker on a node: signalled through the driver (SIGTERM over
    its link too), its exit reported by the driver (after SIGTERM, its channel's end).
    `link` is its port (`address` its URL), `node_id` its Ray node."""

    def __init__(self, launcher: RayLauncher, started: WorkerStarted) -> None:
        self._launcher = launcher
        self._key = started.key
        self.pid = started.pid
        self.actor = started.actor  # its actor's name: a new driver follows it by that
        self.link = LinkAddress(started.host, started.port, started.path)
        self.node_id = started.node_id
        self.hostname = started.hostname
        self.returncode: int | None = None
        self.why = ""  # why it exited, when the driver knows more than a status
        self.signalled = False  # signalled by the supervisor: its exit is on its way
        self.terminated = False  # SIGTERM: its channel's end is its exit
        self.channel: asyncio.StreamWriter | None = None  # dialed in by the launcher
        self._exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._quiet_until = 0.0

    @property
    def address(self) -> str:
        return self.link.url

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int, /) -> None:
        # Through Ray too: a worker still building its app does not serve its link yet.
        self._ask(SignalWorker(self._key, int(sig)))
        self.signalled = True
        if sig == signal.SIGTERM:
            self.terminated = True
            self._launcher.track(self._stop_over_link())

    def kill(self) -> None:
        """Kill its actor (and so the worker); the driver reports it exited."""
        self._ask(KillWorker(self._key))

    def _ask(self, request: Message) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        try:
            self._launcher.send(request)
        except OSError:  # the driver is gone: so is the worker, reported as it reads its end
            raise ProcessLookupError(self.pid) from None

    def exited(self, code: int, why: str) -> None:
        if self.returncode is None:
            self.returncode, self.why = code, why
            self._exited.set_result(code)

    async def _stop_over_link(self) -> None:
        try:
            await stop_worker(self.link, self._launcher.key)
        except OSError as exc:  # the SIGTERM asked through the driver is on its way
            log.debug("worker pid %d at %s: no stop over its link: %s", self.pid, self.address, exc)

    async def connect(
        self, factory: Callable[[], UpstreamConnection], address: str
    ) -> UpstreamConnection:
        """A data connection (the route's connector): dialed, the key proved, then the
        socket handed to the data path's protocol as it is. Dialed again while it does
        not prove itself (module docstring); WorkerGone when the worker is gone."""
        pause = DIAL_AGAIN_FIRST
        while True:
            try:
                _, conn = await connect(self.link, self._launcher.key, DATA, factory)
                return conn
            except LinkUnproven as exc:
                self._dialing_again(exc)
            except (ConnectionRefusedError, LinkRefused) as exc:
                refused = isinstance(exc, ConnectionRefusedError)
                self.cut("its port refused a connection" if refused else str(exc))
                raise WorkerGone(f"worker pid {self.pid} at {self.address} is gone") from exc
            await asyncio.sleep(pause)
            pause = min(2 * pause, DIAL_AGAIN_MAX)

    def _dialing_again(self, why: LinkUnproven) -> None:
        now = time.monotonic()
        if now >= self._quiet_until:
            self._quiet_until = now + LOG_EVERY
            log.warning(
                "worker pid %d at %s: a data connection did not prove itself (%s); dialing "
                "again (its loop may be busy, or its port flooded)", self.pid, self.address, why,
            )  # fmt: skip

    def cut(self, why: str) -> None:
        """Its worker is gone: end its channel, which takes it out of the routes as any
        lost channel does (`_dial_channel` then has its actor killed)."""
        if self.channel is not None and not self.signalled:
            log.warning("worker pid %d at %s: %s; taken as gone", self.pid, self.address, why)
            self.channel.transport.abort()


class RayLauncher:
    """Starts workers on the cluster's nodes through the placement driver (a
    `WorkerLauncher`)."""

    def __init__(
        self,
        spec: PlacementSpec,
        key: bytes,
        boot_timeout: float = START_WAIT,
        driver: tuple[str, ...] = DRIVER_COMMAND,
        placement_wait: float = PLACEMENT_WAIT,
    ) -> None:
        """`boot_timeout`: how long a worker may take to build its app and open its link;
        `driver`: the driver's command (tests start a stand-in that speaks its lines);
        `placement_wait`: how long a worker that does not fit yet waits for the cluster
        to grow."""
        self.boot_timeout = boot_timeout
        self.wait_for_room = placement_wait
        self.spec = spec
        self.key = key
        self._driver_command = driver
        self._launch = Launch()
        self._driver: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._next_key = 0
        self._starting: dict[int, asyncio.Future[WorkerStarted]] = {}
        self._workers: dict[int, RemoteWorker] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # channels, stops over links
        self._replaced: list[float] = []  # when drivers that died were replaced
        self._finding: asyncio.Future[list[str]] | None = None
        self._left: dict[str, RemoteWorker] = {}  # a predecessor's workers, by address
        self._letting_go = False  # passed on to a successor (`let_go`)

    async def open(self, launch: Launch) -> None:
        """Start the driver on the cluster `launch` names; RayError (one line) when the
        cluster cannot hold the workers or cannot be joined."""
        if launch.ray_address is None or launch.accept_channel is None:
            raise RayError("placing workers on Ray needs the cluster's address and a channel")
        self._launch = launch
        said = await self._start_driver()
        grows = f"{said.most} once grown" if said.most >= 0 else "no bound it reports"
        log.info(
            "Ray placement: %s workers of {%s} each on a cluster of %s nodes with room for %s "
            "now (%s)", self.spec.workers, self.need, said.nodes, said.room, grows,
        )  # fmt: skip
        most = self.spec.most_workers or self.spec.workers
        if 0 <= said.most < most:
            log.warning(
                "the Ray cluster grows to room for %d workers of {%s} at most: a resize past "
                "that waits %g s (--placement-wait) and stops there", said.most, self.need,
                self.wait_for_room,
            )  # fmt: skip
        self._reader = asyncio.ensure_future(self._read())

    @property
    def need(self) -> str:
        """What each worker asks of Ray, as the driver's lines name it."""
        need = {"CPU": self.spec.cpus, **self.spec.resources}
        return ", ".join(f"{k} {v:g}" for k, v in need.items())

    async def _start_driver(self) -> DriverReady:
        """A driver, ready; RayError (one line, the driver stopped) when it is not."""
        assert self._launch.ray_address is not None
        self._driver = await asyncio.create_subprocess_exec(
            *self._driver_command, self._launch.ray_address,
            encode_line(self.spec).decode().rstrip("\n"),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=STREAM_LIMIT,
            env={**os.environ, **self._launch.environment},
        )  # fmt: skip
        assert self._driver.stdout is not None
        try:
            said = await greeting(
                self._driver.stdout, START_WAIT, PLACEMENT, DRIVER, DriverReady, DriverFailed
            )
        except TimeoutError:
            await self._stop_driver()
            raise RayError(f"the Ray placement driver did not start in {START_WAIT:g} s") from None
        if not isinstance(said, DriverReady):
            await self._stop_driver()
            raise RayError(said)
        return said

    async def spawn(self, argv: list[str]) -> RemoteWorker:
        """Start a worker on a node and dial its channel in; OSError when it cannot start.
        Its socket and coordinator are its node host's (`proxy.ray_cluster.worker_host`),
        not the local paths the supervisor names."""
        if self._reader is None or self._reader.done():
            raise OSError("the Ray placement driver is not running")
        argv = [a for a in argv if not a.startswith(("--socket=", "--coordinator="))]
        env = {
            **remote_environment(os.environ), **self._launch.environment,
            LINK_KEY_ENV: self.key.hex(),
        }  # fmt: skip
        give_up = time.monotonic() + PLACE_AGAIN_FOR
        while True:
            key = self._next_key = self._next_key + 1
            starting = self._starting[key] = asyncio.get_running_loop().create_future()
            self.send(Spawn(key, argv, env, os.getcwd()))
            try:
                started = await self._placed(key, starting)
                break
            except ActorLost as exc:
                # Placed on a node that died before Ray knew: Ray places it again.
                if time.monotonic() > give_up:
                    raise OSError(str(exc)) from None
                log.warning("placing a worker again: %s", exc)
                await asyncio.sleep(PLACE_AGAIN_PAUSE)
            finally:
                self._starting.pop(key, None)
        if started.path and os.path.dirname(started.path) != self.spec.runtime_dir:
            self.send(KillWorker(key))  # only gym-proxy's own directory is private
            raise OSError(f"a worker's host reported a socket outside {self.spec.runtime_dir}")
        worker = self._workers[key] = RemoteWorker(self, started)
        log.info(
            "worker pid %d placed on Ray node %s (%s), port %s",
            worker.pid, worker.node_id[:12], worker.hostname, worker.address,
        )  # fmt: skip
        self.track(self._dial_channel(worker))
        return worker

    async def _placed(self, key: int, starting: asyncio.Future[WorkerStarted]) -> WorkerStarted:
        """The worker `key` started; while its actor waits for room (Ray's autoscaler
        adding a node), one warning after PENDING_SAY, and OSError past --placement-wait.
        Given up or cancelled (an autoscale grow giving way), its pending actor is killed,
        so that a node added for it later starts nothing."""
        said = min(PENDING_SAY, self.wait_for_room)
        try:
            try:
                return await asyncio.wait_for(asyncio.shield(starting), said)
            except TimeoutError:
                log.warning(
                    "a worker of {%s} waits for room on the Ray cluster (%g s so far; Ray's "
                    "autoscaler adds a node for it if the cluster may grow; given up after "
                    "%g s, --placement-wait)", self.need, said, self.wait_for_room,
                )  # fmt: skip
            try:
                return await asyncio.wait_for(
                    asyncio.shield(starting), max(0.0, self.wait_for_room - said)
                )
            except TimeoutError:
                raise OSError(
                    f"no room on the Ray cluster for a worker of {{{self.need}}} within "
                    f"{self.wait_for_room:g} s (--placement-wait): the cluster did not grow"
                ) from None
        except BaseException:
            if not starting.done() or starting.exception() is None:
                with contextlib.suppress(OSError):  # no driver: its actors go with it
                    self.send(KillWorker(key))
            raise

    def track(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` as a task of the launcher's, cancelled when it closes."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dial_channel(self, worker: RemoteWorker) -> None:
        try:
            reader, writer = await self._channel_of(worker)
        except OSError as exc:
            log.error("worker pid %d at %s: its channel: %s", worker.pid, worker.address, exc)
            with contextlib.suppress(ProcessLookupError):
                worker.kill()
            return
        worker.channel = writer
        assert self._launch.accept_channel is not None  # open() said so
        try:
            await self._launch.accept_channel(reader, writer)
        finally:
            worker.channel = None
        if self._letting_go:
            return  # the successor dials its own channel to it
        # Its channel ended. A worker told to stop closes it last, after its app's
        # shutdown: that is its exit (Ray's report of it can come late on a loaded
        # machine, and the driver ends its actor). One that ends by itself exits next.
        # One whose node died never says so: its actor is killed, so that its slot is
        # reaped now, not when Ray notices the node.
        if worker.terminated:
            worker.exited(0, "")
        elif worker.returncode is None and not worker.signalled:
            try:
                await asyncio.wait_for(worker.wait(), LOST_EXIT_WAIT)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    worker.kill()

    async def _channel_of(self, worker: RemoteWorker) -> tuple[StreamReader, StreamWriter]:
        """The worker's channel, dialed (again while it does not prove itself) until its
        boot timeout: its port listens from the start, the worker accepts once its app
        is built."""
        give_up = time.monotonic() + self.boot_timeout
        pause = DIAL_AGAIN_FIRST
        while True:
            left = give_up - time.monotonic()
            try:
                return await dial(worker.link, self.key, CHANNEL, STREAM_LIMIT, left)
            except LinkUnproven:
                if time.monotonic() + pause >= give_up:
                    raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, DIAL_AGAIN_MAX)

    def send(self, request: Message) -> None:
        driver = self._driver
        if driver is None or driver.stdin is None or driver.stdin.is_closing():
            raise OSError("the Ray placement driver is not running")
        driver.stdin.write(encode_line(request))

    async def _read(self) -> None:
        """The driver's lines, for as long as the launcher is open: a driver that dies is
        replaced by one that follows its workers' actors (they outlive it), so that no
        worker is lost to it; only when no driver can be had are they all taken as gone."""
        while True:
            await self._read_driver()
            why = await self._driver_lost()
            if not why:
                break
            for starting in self._starting.values():  # the replacement cannot answer them
                if not starting.done():
                    starting.set_exception(OSError(why))
            try:
                await self._replace_driver(why)
            except (RayError, OSError) as exc:
                log.error("no Ray placement driver: %s; its workers are taken as gone", exc)
                break
        for starting in self._starting.values():
            if not starting.done():
                starting.set_exception(OSError("the Ray placement driver exited"))
        for worker in self._workers.values():
            worker.exited(EXIT_UNKNOWN, "the Ray placement driver exited")
        self._workers.clear()

    async def _driver_lost(self) -> str:
        """Why the driver whose lines ended is gone; "" when the launcher closes it."""
        driver = self._driver
        if driver is None:
            return ""
        code = await driver.wait()
        return f"the Ray placement driver exited with code {code}"

    async def _replace_driver(self, why: str) -> None:
        now = time.monotonic()
        self._replaced = [t for t in self._replaced if now - t < REPLACE_WINDOW] + [now]
        if len(self._replaced) > REPLACE_AT_MOST:
            raise RayError(f"{why}, the {len(self._replaced)}th in {REPLACE_WINDOW:g} s")
        log.warning(
            "%s; starting another, which follows the %d workers' actors", why, len(self._workers)
        )
        await self._start_driver()
        for key, worker in self._workers.items():
            self.send(FollowWorker(key, worker.actor))

    async def _read_driver(self) -> None:
        assert self._driver is not None and self._driver.stdout is not None
        while line := await self._driver.stdout.readline():
            try:
                said = decode_line(line, PLACEMENT, DRIVER)
                if not isinstance(said, DRIVER_SAYS):
                    raise LineError(f"{DRIVER} sent {said.TYPE!r}, which it does not send now")
            except LineError as exc:  # refused: no worker's state follows a line unread
                log.error("%s; ignored", exc)
                continue
            if isinstance(said, FoundWorkers):
                if self._finding is not None and not self._finding.done():
                    self._finding.set_result(said.actors)
                continue
            starting = self._starting.get(said.key)
            if isinstance(said, WorkerExited) and starting is not None and not starting.done():
                starting.set_exception(OSError(said.why))  # a followed actor that is gone
                continue
            if isinstance(said, WorkerExited):
                worker = self._workers.pop(said.key, None)
                if worker is not None:
                    if said.why:
                        log.warning("worker pid %d on %s: %s", worker.pid, worker.hostname,
                                    said.why)  # fmt: skip
                    worker.exited(said.code, said.why)
                continue
            if starting is not None and not starting.done():
                if isinstance(said, NotStarted):
                    starting.set_exception((ActorLost if said.lost else OSError)(said.error))
                else:
                    starting.set_result(said)

    async def find(self) -> int:
        """Follow the workers a predecessor with this runtime directory left alive (a
        gym-proxy that died with `--orphan-grace`); how many (`left` has their handles,
        `dial_left` their channels)."""
        finding = self._finding = asyncio.get_running_loop().create_future()
        self.send(FindWorkers())
        try:
            names = await asyncio.wait_for(finding, START_WAIT)
        finally:
            self._finding = None
        for name in names:
            key = self._next_key = self._next_key + 1
            starting = self._starting[key] = asyncio.get_running_loop().create_future()
            self.send(FollowWorker(key, name))
            try:
                started = await asyncio.wait_for(starting, START_WAIT)
            except (OSError, TimeoutError) as exc:
                log.warning("not adopting the placed worker of actor %s: %s", name, exc)
                continue
            finally:
                self._starting.pop(key, None)
            worker = self._workers[key] = RemoteWorker(self, started)
            self._left[worker.address] = worker
            log.info(
                "found the placed worker pid %d (actor %s) on Ray node %s, port %s",
                worker.pid, name, worker.node_id[:12], worker.address,
            )  # fmt: skip
        return len(self._left)

    def dial_left(self) -> None:
        """Dial the channels of the workers `find` found: each rejoins over its own."""
        for worker in self._left.values():
            self.track(self._dial_channel(worker))

    def let_go(self) -> None:
        """A `--take-over` successor takes the workers: their channels' ends are no exits
        here, and closing leaves their actors (the driver keeps them for the successor,
        which finds them as it finds a dead predecessor's)."""
        self._letting_go = True

    def left(self, address: str) -> RemoteWorker | None:
        """The handle `find` made of the predecessor's worker listening at `address`."""
        return self._left.get(address)

    async def close(self) -> None:
        """Stop the driver: it kills every actor left and leaves the cluster."""
        if not self._letting_go:
            with contextlib.suppress(OSError):
                self.send(StopWorkers())  # for good: not a death, after which actors are kept
        await self._stop_driver()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _stop_driver(self) -> None:
        driver, self._driver = self._driver, None
        if driver is None:
            return
        if driver.stdin is not None:
            driver.stdin.close()
        try:
            await asyncio.wait_for(driver.wait(), STOP_WAIT)
        except TimeoutError:
            log.warning("the Ray placement driver did not stop in %g s; killing it", STOP_WAIT)
            with contextlib.suppress(ProcessLookupError):
                driver.kill()
            await driver.wait()

"""One Ray cluster for all of a server's workers, as NeMo Gym has it.

NeMo Gym initializes Ray once, in the process that starts the server processes (its
launcher, or the main process of its own multi-worker path), and hands every server the
cluster's address in the global config (`ray_head_node_address`), which its
`initialize_ray()` then joins. gym-proxy does the same for a NeMo Gym server class that
uses Ray (NeMo Gym's own rule, `_server_uses_ray`): before any worker starts,

- it joins the cluster the config names (`ray_head_node_address`, as NeMo Gym's launcher
  passes it), else the one `RAY_ADDRESS` names, after checking that it can be joined
  (`proxy.ray_cluster.head check`): nothing answering, an address that is not one, or an
  authentication that does not fit is one line and exit status RAY_ERROR within
  seconds, not a worker hanging until the boot timeout. It is joined with token
  authentication when a token is at hand and `RAY_AUTH_MODE` is unset, as
  `ray start --head` decides it (Ray 2.60 turns it on by itself only for a cluster
  `ray.init()` starts or finds, so NeMo Gym's `initialize_ray()` in a worker would not,
  nor would `ray start --address`), and the workers get the mode the check joined with;
- else it starts one local cluster (`proxy.ray_cluster.head start`), never attaching to one found
  on the host by a session file, and stops it when gym-proxy stops (its process holds it;
  if that process dies, Ray's reaper stops it). With `--orphan-grace`, a gym-proxy that
  dies (or hands its workers over, `--take-over`) leaves the cluster waiting as long as
  its workers wait, and the gym-proxy that adopts them takes the cluster over through
  the socket its process listens on in the runtime directory (`HEAD_SOCKET`): the
  adopted workers, already its drivers, and the new ones join the same cluster.

What the two processes say to each other is `proxy.ray_cluster.lines.RAY_HEAD`; a line of
the Ray process's that this one cannot read is refused in one line naming it.

Every worker, the first ones and every one that starts later (a restart, a rolling
restart, a resize, a recycle), gets the address in the global config it is given, and
the authentication mode in its environment. The proxy process is never a Ray driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from dataclasses import dataclass

from gym_proxy.coordinator.contract.lines import LineError, encode_line, expect, greeting
from gym_proxy.coordinator.contract.trust import peer_of
from gym_proxy.proxy.adopted_process import AdoptedProcess
from gym_proxy.proxy.ray_cluster.errors import RayError
from gym_proxy.proxy.ray_cluster.lines import (
    HEAD,
    RAY_HEAD,
    ClusterAddress,
    HeadError,
    StopCluster,
    Stopping,
)

__all__ = ["HEAD_SOCKET", "RayPlan", "RayCluster"]

log = logging.getLogger("gym_proxy.ray")

START_WAIT = 120.0  # seconds for `ray.init()` of a local cluster (7 s here, idle)
CHECK_WAIT = 60.0  # seconds for joining a named cluster as a driver, and leaving
STOP_WAIT = 10.0  # seconds for `ray.shutdown()` of the cluster gym-proxy started
AUTH_MODE = "RAY_AUTH_MODE"
HEAD_SOCKET = "ray-head.sock"  # in the runtime directory: where a successor takes the cluster
TAKE_WAIT = 10.0  # seconds for a waiting cluster's process to answer its successor


@dataclass(frozen=True)
class RayPlan:
    """Which cluster the workers join: the one at `address`, which `named_by` names (the
    config's `ray_head_node_address`, or `RAY_ADDRESS`), or with `address` None a local
    cluster gym-proxy starts."""

    address: str | None
    named_by: str = ""


class RayCluster:
    """The cluster of a `RayPlan`: started or checked, then stopped (module docstring)."""

    def __init__(self, plan: RayPlan, keep_for: float = 0.0, socket_path: str = "") -> None:
        """`keep_for`, `socket_path`: how long a local cluster waits for the next gym-proxy
        when this one dies, and where that one takes it (module docstring)."""
        self.plan = plan
        self.address = ""
        self.auth_mode: str | None = None
        self._head: asyncio.subprocess.Process | None = None
        self._keep_for = keep_for
        self._socket_path = socket_path
        self._head_taken_over: tuple[asyncio.StreamWriter, AdoptedProcess] | None = None

    @property
    def environment(self) -> dict[str, str]:
        """What a worker's environment needs to join (beyond the address in its config)."""
        return {AUTH_MODE: self.auth_mode} if self.auth_mode else {}

    async def start(self) -> None:
        """Start the local cluster, or check the named one; RayError if neither works."""
        if self.plan.address is None:
            taken = await self._take_waiting()
            if taken is not None:
                self.address, self.auth_mode = taken.address, taken.auth_mode
                log.info(
                    "Ray: took over the local cluster at %s from the previous gym-proxy",
                    self.address,
                )
                return
            started = await self._start_head()
            self.address, self.auth_mode = started.address, started.auth_mode
            log.info(
                "Ray: started a local cluster at %s for the workers (no cluster was named: "
                "neither ray_head_node_address in the NeMo Gym config nor RAY_ADDRESS)",
                self.address,
            )
            return
        checked = await self._check(self.plan.address)
        if isinstance(checked, HeadError):
            raise RayError(f"{checked.error} (named by {self.plan.named_by})")
        self.address, self.auth_mode = checked.address, checked.auth_mode
        log.info(
            "Ray: the workers join the cluster at %s, named by %s%s",
            self.address,
            self.plan.named_by,
            f" (authentication: {self.auth_mode})" if self.auth_mode else "",
        )

    async def _spawn(self, *args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-P",  # the user's working directory must not shadow the packages it imports
            "-m",
            "gym_proxy.proxy.ray_cluster.head",
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )

    async def _take_waiting(self) -> ClusterAddress | None:
        """The cluster a dead instance left waiting in the runtime directory this one
        adopted; None when there is none to take."""
        if not self._socket_path:
            return None
        try:
            reader, writer = await asyncio.open_unix_connection(self._socket_path)
            line = await asyncio.wait_for(reader.readline(), TAKE_WAIT)
        except FileNotFoundError:
            return None  # none waits: the dead instance's cluster is gone, or it had none
        except (OSError, TimeoutError) as exc:
            log.warning("Ray: the dead instance's cluster cannot be taken over (%s)", exc)
            return None
        if not line:  # it closed the connection: it takes no holder any more
            writer.close()
            return None
        try:
            taken = expect(line, RAY_HEAD, HEAD, ClusterAddress)
        except LineError as exc:
            log.warning("Ray: the dead instance's cluster cannot be taken over (%s)", exc)
            writer.close()
            return None
        # Watched through a pidfd (it is not this process's child), named by the kernel.
        self._head_taken_over = (
            writer,
            AdoptedProcess(peer_of(writer.get_extra_info("socket")).pid),
        )
        return taken

    async def _start_head(self) -> ClusterAddress:
        keep = (
            (str(self._keep_for), self._socket_path) if self._keep_for and self._socket_path else ()
        )
        head = self._head = await self._spawn("start", *keep)
        assert head.stdout is not None
        try:
            said = await greeting(
                head.stdout, START_WAIT, RAY_HEAD, HEAD, ClusterAddress, HeadError
            )
        except TimeoutError:
            await self.stop()
            raise RayError(f"Ray did not start a local cluster within {START_WAIT:g} s") from None
        if not isinstance(said, ClusterAddress):
            await self.stop()
            raise RayError(f"Ray could not start a local cluster: {said}")
        return said

    async def _check(self, address: str) -> ClusterAddress | HeadError:
        check = await self._spawn("check", address)
        try:
            out, _ = await asyncio.wait_for(check.communicate(), CHECK_WAIT)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                check.kill()
            await check.wait()
            return HeadError(f"joining the Ray cluster at {address} took over {CHECK_WAIT:g} s")
        if not out.strip():
            return HeadError(f"cannot join the Ray cluster at {address} (its log is above)")
        try:  # its last line: what Ray printed on stdout before it is not ours
            return expect(out.splitlines()[-1], RAY_HEAD, HEAD, ClusterAddress, HeadError)
        except LineError as exc:
            return HeadError(f"cannot join the Ray cluster at {address}: {exc}")

    def stopping(self) -> None:
        """gym-proxy stops: should it die before `stop`, the cluster waits for no successor
        (its workers do not either: `ProxyStopping`)."""
        if self._head_taken_over is not None:
            self._head_taken_over[0].write(encode_line(Stopping()))
        elif self._head is not None and self._head.stdin is not None:
            self._head.stdin.write(encode_line(Stopping()))

    async def stop(self, keep: bool = False) -> None:
        """Stop the cluster gym-proxy started or took (nothing for a named one); `keep`: a
        hand-over, the cluster waits for the new gym-proxy."""
        head, self._head = self._head, None
        taken, self._head_taken_over = self._head_taken_over, None
        if taken is not None:
            writer, process = taken
            if not keep:
                writer.write(encode_line(StopCluster()))
            writer.close()
            if not keep:
                await _stopped(process)
            return
        if head is None or head.returncode is not None:
            return
        assert head.stdin is not None
        if not keep:
            head.stdin.write(encode_line(StopCluster()))
        head.stdin.close()
        if keep:
            return
        await _stopped(head)


async def _stopped(head: asyncio.subprocess.Process | AdoptedProcess) -> None:
    """Wait for the cluster's process to shut it down and exit; kill it after STOP_WAIT."""
    try:
        await asyncio.wait_for(head.wait(), STOP_WAIT)
        log.info("Ray: stopped the local cluster")
    except TimeoutError:
        log.warning("Ray: the local cluster did not stop in %g s; killing it", STOP_WAIT)
        with contextlib.suppress(ProcessLookupError):
            head.kill()  # Ray's reaper then stops what the cluster left
        await head.wait()

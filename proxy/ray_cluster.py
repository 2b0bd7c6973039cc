"""One Ray cluster for all of a server's workers, as NeMo Gym has it.

NeMo Gym initializes Ray once, in the process that starts the server processes (its
launcher, or the main process of its own multi-worker path), and hands every server the
cluster's address in the global config (`ray_head_node_address`), which its
`initialize_ray()` then joins. gym-proxy does the same for a NeMo Gym server class that
uses Ray (NeMo Gym's own rule, `_server_uses_ray`): before any worker starts,

- it joins the cluster the config names (`ray_head_node_address`, as NeMo Gym's launcher
  passes it), else the one `RAY_ADDRESS` names, after checking that it can be joined
  (`proxy.ray_head check`): nothing answering, an address that is not one, or an
  authentication that does not fit is one line and exit status RAY_ERROR within
  seconds, not a worker hanging until the boot timeout. It is joined with token
  authentication when a token is at hand and `RAY_AUTH_MODE` is unset, as
  `ray start --head` decides it (Ray 2.60 turns it on by itself only for a cluster
  `ray.init()` starts or finds, so NeMo Gym's `initialize_ray()` in a worker would not,
  nor would `ray start --address`), and the workers get the mode the check joined with;
- else it starts one local cluster (`proxy.ray_head start`), never attaching to one found
  on the host by a session file, and stops it when gym-proxy stops (its process holds it;
  if that process dies, Ray's reaper stops it).

Every worker, the first ones and every one that starts later (a restart, a rolling
restart, a resize, a recycle), gets the address in the global config it is given, and
the authentication mode in its environment. The proxy process is never a Ray driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from dataclasses import dataclass

__all__ = ["RAY_ERROR", "RayError", "RayPlan", "RayCluster"]

log = logging.getLogger("gym_proxy.ray")

RAY_ERROR = 5  # gym-proxy's exit status: the Ray cluster could not be started or joined
START_WAIT = 120.0  # seconds for `ray.init()` of a local cluster (7 s here, idle)
CHECK_WAIT = 60.0  # seconds for joining a named cluster as a driver, and leaving
STOP_WAIT = 10.0  # seconds for `ray.shutdown()` of the cluster gym-proxy started
AUTH_MODE = "RAY_AUTH_MODE"


class RayError(RuntimeError):
    """The Ray cluster could not be started or joined: one line for the user."""


@dataclass(frozen=True)
class RayPlan:
    """Which cluster the workers join: the one at `address`, which `named_by` names (the
    config's `ray_head_node_address`, or `RAY_ADDRESS`), or with `address` None a local
    cluster gym-proxy starts."""

    address: str | None
    named_by: str = ""


class RayCluster:
    """The cluster of a `RayPlan`: started or checked, then stopped (module docstring)."""

    def __init__(self, plan: RayPlan) -> None:
        self.plan = plan
        self.address = ""
        self.auth_mode: str | None = None
        self._head: asyncio.subprocess.Process | None = None

    @property
    def environment(self) -> dict[str, str]:
        """What a worker's environment needs to join (beyond the address in its config)."""
        return {AUTH_MODE: self.auth_mode} if self.auth_mode else {}

    async def start(self) -> None:
        """Start the local cluster, or check the named one; RayError if neither works."""
        if self.plan.address is None:
            reply = await self._start_head()
            self.address, self.auth_mode = reply["address"], reply.get("auth_mode")
            log.info(
                "Ray: started a local cluster at %s for the workers (no cluster was named: "
                "neither ray_head_node_address in the NeMo Gym config nor RAY_ADDRESS)",
                self.address,
            )
            return
        reply = await self._check(self.plan.address)
        if "error" in reply:
            raise RayError(f"{reply['error']} (named by {self.plan.named_by})")
        self.address, self.auth_mode = reply["address"], reply.get("auth_mode")
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
            "gym_proxy.proxy.ray_head",
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )

    async def _start_head(self) -> dict[str, str]:
        head = self._head = await self._spawn("start")
        assert head.stdout is not None
        try:
            line = await asyncio.wait_for(head.stdout.readline(), START_WAIT)
        except TimeoutError:
            await self.stop()
            raise RayError(f"Ray did not start a local cluster within {START_WAIT:g} s") from None
        reply = _reply(line)
        if "address" not in reply:
            await self.stop()
            why = reply.get("error") or "its process ended (its log is above)"
            raise RayError(f"Ray could not start a local cluster: {why}")
        return reply

    async def _check(self, address: str) -> dict[str, str]:
        check = await self._spawn("check", address)
        try:
            out, _ = await asyncio.wait_for(check.communicate(), CHECK_WAIT)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                check.kill()
            await check.wait()
            return {"error": f"joining the Ray cluster at {address} took over {CHECK_WAIT:g} s"}
        reply = _reply(out.splitlines()[-1] if out.strip() else b"")
        if "address" not in reply and "error" not in reply:
            reply["error"] = f"cannot join the Ray cluster at {address} (its log is above)"
        return reply

    async def stop(self) -> None:
        """Stop the cluster gym-proxy started (nothing for a named one)."""
        head, self._head = self._head, None
        if head is None or head.returncode is not None:
            return
        assert head.stdin is not None
        head.stdin.close()  # its signal to shut the cluster down
        try:
            await asyncio.wait_for(head.wait(), STOP_WAIT)
            log.info("Ray: stopped the local cluster")
        except TimeoutError:
            log.warning("Ray: the local cluster did not stop in %g s; killing it", STOP_WAIT)
            with contextlib.suppress(ProcessLookupError):
                head.kill()  # Ray's reaper then stops what the cluster left
            await head.wait()


def _reply(line: bytes) -> dict[str, str]:
    try:
        reply = json.loads(line)
    except ValueError:
        return {}
    return reply if isinstance(reply, dict) else {}

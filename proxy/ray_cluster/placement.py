"""The Ray driver that places a server's workers on the cluster's nodes
(`--worker-placement ray`), one actor per worker.

Run by `proxy.fleet.remote_workers.RayLauncher` as `python -m
gym_proxy.proxy.ray_cluster.placement ADDRESS SPEC`, it joins the server's cluster (the one
gym-proxy started or checked, `proxy.ray_cluster.cluster`) and talks JSON lines with the
proxy: requests on stdin, answers and events on the stdout it had at start (Ray's own
lines, and the workers' log lines Ray forwards from the nodes, go to stderr, the proxy's
log). The proxy process never imports Ray; this process is the owner of every worker's
actor, so they end with it.

- At start it checks that the cluster's nodes have room for the workers asked (SPEC:
  `{"workers", "cpus", "resources", "strategy", "instance", "runtime_dir"}`, by each
  node's total, as Ray schedules them), and says `{"ready": {...}}`, or
  `{"error": "<one line>"}` and exits 1.
- `{"op": "spawn", "id", "argv", "env", "cwd"}`: a `RayWorkerHost` actor with the
  resources asked and the strategy (SPREAD unless the config says DEFAULT), which starts
  the worker on its node; answers `{"id", "started": {pid, host, port, node_id, hostname}}`
  or `{"id", "error", "lost"}` (`lost`: its actor died first, its node likely gone), and
  later `{"id", "exited": CODE, "why"}` when the worker exits or its actor dies (its node
  gone: `why` says so, CODE is EXIT_UNKNOWN).
- `{"op": "signal", "id", "signal"}` signals the worker; `{"op": "kill", "id"}` kills its
  actor (and so the worker, which loses its channel) and reports it exited.
- stdin's end or SIGTERM: every actor is killed and seen dead, and the driver ends (its
  job with it). SIGINT is ignored: Ctrl-C in a terminal reaches the whole process group,
  and gym-proxy decides (it stops the workers, which finish their requests, then closes
  stdin), as its local workers leave it to decide.
- A gym-proxy killed with -9 (NeMo Gym's launcher does so to a server that is not gone
  one second after its SIGINT) cannot remove its runtime directory: this process, which
  outlives it, does once its actors are killed, if the directory's lock says its
  gym-proxy is dead (`proxy.runtime_dir.remove_abandoned`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from gym_proxy.coordinator.contract.exit_codes import EXIT_UNKNOWN, FAILED, USAGE_ERROR
from gym_proxy.proxy.runtime_dir import remove_abandoned

__all__ = ["main", "room_for"]

NAMESPACE = "gym-proxy"
STOP_WAIT = 10.0  # seconds the actors get to be dead at the end


class _Out:
    """The proxy's end: one JSON line at a time, from any thread."""

    def __init__(self, fd: int) -> None:
        self._file = os.fdopen(fd, "w")
        self._lock = threading.Lock()

    def say(self, **fields: Any) -> None:
        with self._lock:
            self._file.write(json.dumps(fields) + "\n")
            self._file.flush()


def room_for(nodes: list[dict[str, Any]], need: dict[str, float]) -> int:
    """How many workers needing `need` the alive nodes hold at most, by their totals."""
    room = 0
    for node in nodes:
        if not node.get("Alive"):
            continue
        total = node.get("Resources", {})
        fits = [int(total.get(name, 0.0) // amount) for name, amount in need.items() if amount > 0]
        room += min(fits) if fits else 1 << 30
    return room


class _Stop(Exception):
    """SIGTERM: stop as at stdin's end."""


def _stop(*_: object) -> None:
    raise _Stop


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _Placement:
    def __init__(self, out: _Out, spec: dict[str, Any]) -> None:
        import ray

        from gym_proxy.proxy.ray_cluster.worker_host import RayWorkerHost

        self.ray = ray
        self.out = out
        self.need = {"CPU": float(spec["cpus"]), **spec.get("resources", {})}
        custom = {k: v for k, v in self.need.items() if k not in ("CPU", "GPU")}
        options: dict[str, Any] = {
            "num_cpus": self.need["CPU"],
            "num_gpus": self.need.get("GPU", 0.0),  # Ray takes GPUs apart from the others
            "resources": custom,
            "scheduling_strategy": spec.get("strategy", "SPREAD"),
            "max_restarts": 0,
            "max_concurrency": 4,  # `wait` blocks one thread; `signal` needs another
        }
        self.host_class = ray.remote(RayWorkerHost).options(**options)
        self.instance = spec.get("instance", "")
        self.actors: dict[int, Any] = {}
        self.watchers: list[threading.Thread] = []  # one per actor, until it is dead
        self.lock = threading.Lock()
        self.stopping = False

    def spawn(self, request: dict[str, Any]) -> None:
        key = int(request["id"])
        actor = self.host_class.remote()
        with self.lock:
            if self.stopping:
                self.ray.kill(actor)
                self.out.say(id=key, error="gym-proxy is stopping")
                return
            self.actors[key] = actor
            watcher = threading.Thread(target=self._run, args=(key, actor, request), daemon=True)
            self.watchers.append(watcher)
        watcher.start()

    def _run(self, key: int, actor: Any, request: dict[str, Any]) -> None:
        ray = self.ray
        try:
            call = actor.start_here.remote(request["argv"], request["env"], request.get("cwd", ""))
            started = ray.get(call)
        except Exception as exc:
            self._forget(key)
            lost = isinstance(exc, ray.exceptions.RayActorError)  # placed again by the proxy
            why = f"the worker's actor could not start it: {_first_line(exc)}"
            self.out.say(id=key, error=why, lost=lost)
            return
        self.out.say(id=key, started=started)
        try:
            code, why = ray.get(actor.wait.remote()), ""
        except ray.exceptions.RayActorError as exc:
            code, why = EXIT_UNKNOWN, f"its Ray actor died: {_first_line(exc)}"
        except Exception as exc:
            code, why = EXIT_UNKNOWN, f"its Ray actor cannot be reached: {_first_line(exc)}"
        if self._forget(key):
            self.out.say(id=key, exited=code, why=why)
        self._end(actor)

    def _end(self, actor: Any) -> None:
        """A host whose worker is gone has nothing left to do: kill it, and wait until Ray
        says it is dead (a call on it fails), so that none outlives the driver."""
        self.ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            self.ray.get(actor.__ray_ready__.remote(), timeout=STOP_WAIT)

    def _forget(self, key: int) -> bool:
        with self.lock:
            return self.actors.pop(key, None) is not None

    def signal(self, request: dict[str, Any]) -> None:
        actor = self.actors.get(int(request["id"]))
        if actor is not None:
            actor.signal.remote(int(request["signal"]))

    def kill(self, request: dict[str, Any]) -> None:
        key = int(request["id"])
        actor = self.actors.get(key)
        if actor is not None:
            self.ray.kill(actor, no_restart=True)
            if self._forget(key):
                self.out.say(id=key, exited=-signal.SIGKILL, why="killed with its Ray actor")

    def stop(self) -> None:
        """Kill every actor left and wait (STOP_WAIT at most) until Ray says each is dead
        (each watcher ends with `_end`), so that none is still listed alive once the
        driver has gone."""
        with self.lock:
            self.stopping = True
            actors, self.actors = list(self.actors.values()), {}
        for actor in actors:
            self.ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + STOP_WAIT
        for watcher in self.watchers:
            watcher.join(max(0.0, deadline - time.monotonic()))


def _serve(out: _Out, address: str, spec: dict[str, Any]) -> int:
    import ray

    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
    except Exception as exc:
        out.say(error=f"cannot join the Ray cluster at {address}: {_first_line(exc)}")
        return FAILED
    placement = _Placement(out, spec)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    room = room_for(nodes, placement.need)
    if room < int(spec["workers"]):
        asked = ", ".join(f"{k} {v:g}" for k, v in placement.need.items())
        out.say(
            error=f"the Ray cluster at {address} has room for {room} workers of {{{asked}}} "
            f"on its {len(nodes)} nodes; {spec['workers']} were asked"
        )
        return FAILED
    out.say(ready={"nodes": len(nodes), "room": room})
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # again: whatever Ray set at its init
    try:
        for line in sys.stdin:
            request = json.loads(line)
            op = request.get("op")
            if op == "spawn":
                placement.spawn(request)
            elif op == "signal":
                placement.signal(request)
            elif op == "kill":
                placement.kill(request)
    except (_Stop, ValueError, OSError):
        pass  # a signal, or a line that is not JSON: stop as at the end
    placement.stop()
    runtime_dir = spec.get("runtime_dir")
    if runtime_dir and remove_abandoned(runtime_dir):
        print(
            f"gym-proxy placement: its gym-proxy died; removed its runtime directory {runtime_dir}",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(
            "usage: python -m gym_proxy.proxy.ray_cluster.placement ADDRESS SPEC", file=sys.stderr
        )
        return USAGE_ERROR
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # gym-proxy decides (module docstring)
    out = _Out(os.dup(1))
    os.dup2(2, 1)  # Ray's lines and the nodes' forwarded logs: the proxy's log
    code = _serve(out, args[0], json.loads(args[1]))
    # Every actor is dead by now. `ray.shutdown()` would take 0.3 s more (measured) of the
    # one second NeMo Gym's launcher gives a server to stop; a driver's job ends with its
    # process anyway (Ray's own fate sharing), so the process ends here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

"""The Ray driver that places a server's workers on the cluster's nodes
(`--worker-placement ray`), one actor per worker.

Run by `proxy.ray_cluster.remote_workers.RayLauncher` as `python -m
gym_proxy.proxy.ray_cluster.placement ADDRESS SPEC`, it joins the server's cluster (the one
gym-proxy started or checked, `proxy.ray_cluster.cluster`) and talks in lines with the
proxy (`proxy.ray_cluster.lines.PLACEMENT`): requests on stdin, answers and events on the
stdout it had at start (Ray's own lines, and the workers' log lines Ray forwards from the
nodes, go to stderr, the proxy's log). The proxy process never imports Ray.

The actors are detached and named (namespace NAMESPACE), so that they outlive this
process: should it die alone (killed, out of memory), its workers serve on (their
channels and data connections go from gym-proxy to them, not through here), and the
next driver gym-proxy starts follows them by name. An actor still alive ORPHANED_AFTER
seconds after its worker exited ends itself (`worker_host.RayWorkerHost`): gym-proxy and
its driver both gone leave no actor.

- At start it checks that the cluster's nodes have room for the workers asked (SPEC, a
  `PlacementSpec`, by each node's total, as Ray schedules them), now or once Ray's
  autoscaler has grown it to the bound it reports, and says `ready`, or `failed` (one
  line) and exits 1. A worker that does not fit yet waits, its actor pending, for the
  autoscaler to add a node (the launcher bounds the wait, `--placement-wait`).
- `spawn`: a `RayWorkerHost` actor with the resources asked and the strategy (SPREAD
  unless the config says DEFAULT), which starts the worker on its node; answers `started`
  (its pid, port and node) or `not_started` (`lost`: its actor died first, its node
  likely gone), and later `exited` when the worker exits or its actor dies (its node
  gone: `why` says so, its code is EXIT_UNKNOWN).
- `follow`: a worker's actor a previous driver started, found by its name and watched as
  one of this driver's (`exited` at once when it is gone).
- `signal` signals the worker; `kill` kills its actor (and so the worker, which loses
  its channel) and reports it exited.
- stdin's end or SIGTERM: every actor is killed and seen dead, and the driver ends (its
  job with it); so does a line it cannot read, refused on stderr in one line. SIGINT is
  ignored: Ctrl-C in a terminal reaches the whole process group, and gym-proxy decides
  (it stops the workers, which finish their requests, then closes stdin), as its local
  workers leave it to decide.
- A gym-proxy killed with -9 (NeMo Gym's launcher does so to a server that is not gone
  one second after its SIGINT) cannot remove its runtime directory: this process, which
  outlives it, does once its actors are killed, if the directory's lock says its
  gym-proxy is dead (`proxy.runtime_dir.remove_abandoned`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from gym_proxy.coordinator.contract.exit_codes import EXIT_UNKNOWN, FAILED, USAGE_ERROR
from gym_proxy.coordinator.contract.lines import LineError, decode_line, encode_line, expect
from gym_proxy.coordinator.contract.messages import Message
from gym_proxy.proxy.ray_cluster.lines import (
    LAUNCHER,
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
from gym_proxy.proxy.ray_cluster.node_zygote import name_of
from gym_proxy.proxy.runtime_dir import remove_abandoned

__all__ = ["main", "most_room", "room_for", "requests"]

RESOLUTION = 10_000  # Ray's fixed point for resource amounts

NAMESPACE = "gym-proxy"
STOP_WAIT = 10.0  # seconds the actors get to be dead at the end


class _Out:
    """The proxy's end: one line at a time, from any thread."""

    def __init__(self, fd: int) -> None:
        self._file = os.fdopen(fd, "wb")
        self._lock = threading.Lock()

    def say(self, said: Message) -> None:
        with self._lock:
            self._file.write(encode_line(said))
            self._file.flush()


def room_for(nodes: list[dict[str, Any]], need: dict[str, float]) -> int:
    """How many workers needing `need` the alive nodes hold at most, by their totals."""
    room = 0
    for node in nodes:
        if not node.get("Alive"):
            continue
        total = node.get("Resources", {})
        fits = [_fits(total.get(name, 0.0), amount) for name, amount in need.items() if amount > 0]
        room += min(fits) if fits else 1 << 30
    return room


def _fits(total: float, amount: float) -> int:
    """How many `amount`s `total` holds, in Ray's fixed point (1/10,000 of a unit):
    1.0 // 0.1 is 9 in floats, and Ray places 10 actors of 0.1 CPU on one CPU."""
    return round(total * RESOLUTION) // max(1, round(amount * RESOLUTION))


def most_room(bound: dict[str, float] | None, need: dict[str, float]) -> int:
    """How many workers needing `need` each fit in `bound`, the resources Ray's autoscaler
    reports it may grow the cluster to; -1 when it reports none."""
    if not bound:
        return -1
    fits = [_fits(bound.get(name, 0.0), amount) for name, amount in need.items() if amount > 0]
    return min(fits) if fits else 1 << 30


def _reported_bound(ray: Any) -> dict[str, float] | None:
    """The autoscaler's bound, as Ray Train v2 reads it before it waits for its workers
    (autoscaler v2 and KubeRay report one; v1 and a fixed cluster do not)."""
    try:
        bound = ray._private.state.state.get_max_resources_from_cluster_config()
    except Exception:  # a private call: another Ray may not have it
        return None
    return {str(k): float(v) for k, v in bound.items()} if bound else None


class _Stop(Exception):
    """SIGTERM: stop as at stdin's end."""


def _stop(*_: object) -> None:
    raise _Stop


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _Placement:
    def __init__(self, out: _Out, spec: PlacementSpec) -> None:
        import ray

        from gym_proxy.proxy.ray_cluster.worker_host import RayWorkerHost

        self.ray = ray
        self.out = out
        self.need = {"CPU": float(spec.cpus), **spec.resources}
        custom = {k: v for k, v in self.need.items() if k not in ("CPU", "GPU")}
        options: dict[str, Any] = {
            "num_cpus": self.need["CPU"],
            "num_gpus": self.need.get("GPU", 0.0),  # Ray takes GPUs apart from the others
            "resources": custom,
            "scheduling_strategy": spec.strategy,
            "max_restarts": 0,
            "max_concurrency": 4,  # `wait` blocks one thread; `signal` needs another
            "lifetime": "detached",  # it outlives this driver (module docstring)
            "namespace": NAMESPACE,
        }
        self.host_class = ray.remote(RayWorkerHost)
        self.options = options
        self.instance = spec.instance
        # Actors are named by the runtime directory (fixed by instance and address, so the
        # same command again finds them), then this driver, then the worker's key.
        self.kept = os.path.basename(spec.runtime_dir) or spec.instance
        self.names = f"{self.kept}-{secrets.token_hex(4)}"
        # Where gym-proxy runs (the driver is its child): workers placed on this node
        # listen on Unix sockets in its runtime directory (`worker_host`).
        self.near = (ray.get_runtime_context().get_node_id(), spec.runtime_dir)
        # --preload: each node's zygote, named after this directory (`node_zygote`).
        self.preload = [self.kept, *spec.preload] if spec.preload else None
        self.actors: dict[int, Any] = {}
        self.watchers: list[threading.Thread] = []  # one per actor, until it is dead
        self.lock = threading.Lock()
        self.stopping = False

    def spawn(self, request: Spawn) -> None:
        key = request.key
        name = f"{self.names}-{key}"
        actor = self.host_class.options(name=name, **self.options).remote()
        self._watch(key, actor, lambda: self._start(key, name, actor, request))

    def follow(self, request: FollowWorker) -> None:
        """Watch the actor a previous driver started for the worker `key`; say where its
        worker listens (`started`), or that it is gone (`exited`)."""
        key = request.key
        try:
            actor = self.ray.get_actor(request.actor, namespace=NAMESPACE)
        except ValueError:  # no such actor alive: its worker is gone
            why = f"its Ray actor {request.actor} is gone"
            self.out.say(WorkerExited(key, EXIT_UNKNOWN, why))
            return
        self._watch(key, actor, lambda: self._where(key, request.actor, actor))

    def _where(self, key: int, name: str, actor: Any) -> bool:
        try:
            where = self.ray.get(actor.where.remote(), timeout=STOP_WAIT)
        except Exception as exc:
            self._forget(key)
            # Given up on: one still pending (its driver died before a node took it) or
            # broken would otherwise hold its resources, or a node added for it, for good.
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
            why = f"its Ray actor {name} does not answer: {_first_line(exc)}"
            self.out.say(WorkerExited(key, EXIT_UNKNOWN, why))
            return False
        self.out.say(WorkerStarted(key, name, **where))
        return True

    def find(self) -> None:
        """The actors a predecessor with this runtime directory left (their names begin
        with its name, `self.names`'s first part)."""
        prefix = f"{self.kept}-"
        names = [
            name
            for name in self._named(prefix)
            if not name.startswith(name_of(self.kept, ""))  # the nodes' zygotes
        ]
        self.out.say(FoundWorkers(sorted(names)))

    def _named(self, prefix: str) -> list[str]:
        """The names of this namespace's actors that begin with `prefix`."""
        return [
            named["name"]
            for named in self.ray.util.list_named_actors(all_namespaces=True)
            if named.get("namespace") == NAMESPACE and named["name"].startswith(prefix)
        ]

    def _watch(self, key: int, actor: Any, start: Callable[[], bool]) -> None:
        with self.lock:
            if self.stopping:
                self.ray.kill(actor, no_restart=True)
                self.out.say(NotStarted(key, "gym-proxy is stopping"))
                return
            self.actors[key] = actor
            watcher = threading.Thread(target=self._run, args=(key, actor, start), daemon=True)
            self.watchers.append(watcher)
        watcher.start()

    def _start(self, key: int, name: str, actor: Any, request: Spawn) -> bool:
        """Start the worker in `actor`; False (said) when it did not start."""
        ray = self.ray
        try:
            started = ray.get(
                actor.start_here.remote(
                    request.argv, request.env, request.cwd, self.near, self.preload
                )
            )
        except Exception as exc:
            self._forget(key)
            lost = isinstance(exc, ray.exceptions.RayActorError)  # placed again by the proxy
            why = f"the worker's actor could not start it: {_first_line(exc)}"
            self.out.say(NotStarted(key, why, lost))
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)  # detached: it would not end by itself
            return False
        self.out.say(WorkerStarted(key, name, **started))
        return True

    def _run(self, key: int, actor: Any, start: Callable[[], bool]) -> None:
        ray = self.ray
        if not start():
            return
        try:
            code, why = ray.get(actor.wait.remote()), ""
        except ray.exceptions.RayActorError as exc:
            code, why = EXIT_UNKNOWN, f"its Ray actor died: {_first_line(exc)}"
        except Exception as exc:
            code, why = EXIT_UNKNOWN, f"its Ray actor cannot be reached: {_first_line(exc)}"
        if self._forget(key):
            self.out.say(WorkerExited(key, code, why))
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

    def signal(self, request: SignalWorker) -> None:
        actor = self.actors.get(request.key)
        if actor is not None:
            actor.signal.remote(request.signal)

    def kill(self, request: KillWorker) -> None:
        key = request.key
        actor = self.actors.get(key)
        if actor is not None:
            self.ray.kill(actor, no_restart=True)
            if self._forget(key):
                self.out.say(WorkerExited(key, -signal.SIGKILL, "killed with its Ray actor"))

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
        for name in self._named(name_of(self.kept, "")):  # the nodes' zygotes: no worker left
            with contextlib.suppress(Exception):
                self.ray.kill(self.ray.get_actor(name, namespace=NAMESPACE), no_restart=True)


Request = Spawn | FindWorkers | FollowWorker | SignalWorker | KillWorker | StopWorkers
REQUESTS = (Spawn, FindWorkers, FollowWorker, SignalWorker, KillWorker, StopWorkers)


def requests(lines: Iterable[bytes]) -> Iterator[Request]:
    """The launcher's requests, one a line; LineError, naming it, at one this cannot read."""
    for line in lines:
        said = decode_line(line, PLACEMENT, LAUNCHER)
        if not isinstance(said, REQUESTS):
            names = " or ".join(r.TYPE for r in REQUESTS)
            raise LineError(f"{LAUNCHER} sent {said.TYPE!r} where {names} was due")
        yield said


def _serve(out: _Out, address: str, spec: PlacementSpec) -> int:
    import ray

    try:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
    except Exception as exc:
        out.say(DriverFailed(f"cannot join the Ray cluster at {address}: {_first_line(exc)}"))
        return FAILED
    placement = _Placement(out, spec)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    room = room_for(nodes, placement.need)
    most = most_room(_reported_bound(ray), placement.need)
    most = max(most, room) if most >= 0 else most
    if room < spec.workers and most < spec.workers:
        asked = ", ".join(f"{k} {v:g}" for k, v in placement.need.items())
        grows = (
            f"it grows to room for {most} at most"
            if most >= 0
            else "it reports no bound it may grow to (start with what fits; workers started "
            "later wait for it to grow, --placement-wait)"
        )
        out.say(
            DriverFailed(
                f"the Ray cluster at {address} has room for {room} workers of {{{asked}}} "
                f"on its {len(nodes)} nodes; {spec.workers} were asked, and {grows}"
            )
        )
        return FAILED
    out.say(DriverReady(len(nodes), room, most))
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # again: whatever Ray set at its init
    if _serve_requests(placement) or not spec.keep_for:
        placement.stop()
        runtime_dir = spec.runtime_dir
        if runtime_dir and remove_abandoned(runtime_dir):
            print(
                "gym-proxy placement: its gym-proxy died; removed its runtime directory "
                f"{runtime_dir}",
                file=sys.stderr,
            )
    else:
        print(
            "gym-proxy placement: leaving the workers' actors to the gym-proxy that adopts "
            f"them (gone, or passing them on; they wait up to {spec.keep_for:g} s, "
            "--orphan-grace)",
            file=sys.stderr,
        )
    return 0


def _serve_requests(placement: _Placement) -> bool:
    """Carry out the launcher's requests until stdin ends; True when the actors are to be
    killed (`stop_all`, SIGTERM, a line it cannot read), False at stdin's end alone (its
    gym-proxy died: its workers may be adopted)."""
    try:
        for request in requests(sys.stdin.buffer):
            if isinstance(request, StopWorkers):
                return True
            if isinstance(request, Spawn):
                placement.spawn(request)
            elif isinstance(request, FindWorkers):
                placement.find()
            elif isinstance(request, FollowWorker):
                placement.follow(request)
            elif isinstance(request, SignalWorker):
                placement.signal(request)
            else:
                placement.kill(request)
    except LineError as exc:  # its gym-proxy speaks another protocol: stop as at the end
        print(f"gym-proxy placement: {exc}; stopping", file=sys.stderr, flush=True)
        return True
    except _Stop:
        return True
    except OSError:
        pass  # stdin unreadable: as at its end
    return False


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
    try:
        spec = expect(args[1].encode(), PLACEMENT, f"{LAUNCHER}, in SPEC,", PlacementSpec)
    except LineError as exc:
        out.say(DriverFailed(str(exc)))
        return FAILED
    code = _serve(out, args[0], spec)
    # Every actor is dead by now. `ray.shutdown()` would take 0.3 s more (measured) of the
    # one second NeMo Gym's launcher gives a server to stop; a driver's job ends with its
    # process anyway (Ray's own fate sharing), so the process ends here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

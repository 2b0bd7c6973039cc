"""The lines of gym-proxy's two Ray processes, each protocol declared once for both of its
ends and read with `coordinator.contract.lines` (a line a peer cannot read is refused in
one line naming the peer).

The Ray head holder (`RAY_HEAD`): `proxy.ray_cluster.head`, and its holder,
`proxy.ray_cluster.cluster.RayCluster`, at the head's stdin, or at the socket of a
cluster waiting in the runtime directory (`HEAD_SOCKET`) for the gym-proxy that adopts it:

    head -> holder   cluster   the cluster's address and authentication mode (after a
                               start or a check; again to each holder that takes it over)
                     error     why a named cluster cannot be joined (check)
    holder -> head   stopping  its stop has begun: its end is a stop, not a hand-over
                     stop      shut the cluster down

The placement driver (`PLACEMENT`): `proxy.ray_cluster.placement`, and its client,
`proxy.ray_cluster.remote_workers.RayLauncher`, at the driver's stdin and the stdout it
had at start:

    launcher -> driver  spec     the workers asked (its command line's SPEC, one message)
                        spawn    a worker to start, by the launcher's key for it
                        find     the actors a dead predecessor's driver left
                        follow   watch a worker's actor a previous driver started
                        stop_all gym-proxy stops for good: kill every actor
                        signal   a signal for a worker
                        kill     kill a worker's actor (and so the worker)
    driver -> launcher  ready    the cluster holds the workers       } one at start
                        failed   it cannot serve, and why            }
                        found    the actors `find` asked for
                        started  a worker runs, and where            } one a spawn or follow
                        not_started  why not (`lost`: its actor died) }
                        exited   a started worker's exit, and why (its actor died)
"""

from __future__ import annotations

import dataclasses

from gym_proxy.coordinator.contract.messages import Message, message

__all__ = [
    "RAY_HEAD",
    "HEAD",
    "HOLDER",
    "ClusterAddress",
    "HeadError",
    "StopCluster",
    "Stopping",
    "PLACEMENT",
    "DRIVER",
    "LAUNCHER",
    "PlacementSpec",
    "Spawn",
    "FindWorkers",
    "FoundWorkers",
    "StopWorkers",
    "FollowWorker",
    "SignalWorker",
    "KillWorker",
    "DriverReady",
    "DriverFailed",
    "WorkerStarted",
    "NotStarted",
    "WorkerExited",
]

# ---- the Ray head holder ------------------------------------------------------------------
RAY_HEAD: dict[str, type[Message]] = {}  # its messages, by wire type
HEAD = "gym-proxy's Ray process (proxy.ray_cluster.head)"  # the peers, as a refusal names them
HOLDER = "the Ray cluster's holder (gym-proxy)"


@message("cluster", RAY_HEAD)
class ClusterAddress(Message):
    """Head -> holder: the cluster to join (`auth_mode`: RAY_AUTH_MODE as it joined)."""

    address: str
    auth_mode: str | None


@message("error", RAY_HEAD)
class HeadError(Message):
    """Head -> holder: the named cluster cannot be joined (one line for the user)."""

    error: str


@message("stop", RAY_HEAD)
class StopCluster(Message):
    """Holder -> head: shut the cluster down."""


@message("stopping", RAY_HEAD)
class Stopping(Message):
    """Holder -> head: its stop has begun, so should it leave without `stop` (killed
    meanwhile), the cluster waits for no successor."""


# ---- the placement driver ----------------------------------------------------------------
PLACEMENT: dict[str, type[Message]] = {}  # its messages, by wire type
DRIVER = "the Ray placement driver"  # the peers, as a refusal names them
LAUNCHER = "gym-proxy (the Ray launcher)"
# A worker is the launcher's `key` in every message about it (not `id`: a key the
# messages' decode leaves out, as the channel's envelope holds its request id there).


@message("spec", PLACEMENT)
class PlacementSpec(Message):
    """Launcher -> driver, as its command line's SPEC: how many workers, what each needs
    (`cpus`, `resources` beyond them, GPU among them), Ray's scheduling strategy, the
    runtime directory the driver removes should gym-proxy die, and `keep_for`, the
    workers' orphan grace: with one, a gym-proxy that dies leaves its workers' actors to a
    successor (the same command again), which finds them by the directory's name.
    `most_workers`: the most it may be resized to (--max-workers; 0: `workers`);
    `preload` (--preload): what each node's zygote imports (`node_zygote`)."""

    workers: int
    cpus: float
    resources: dict[str, float]
    strategy: str  # SPREAD or DEFAULT
    instance: str
    runtime_dir: str
    keep_for: float = 0.0
    most_workers: int = 0
    preload: list[str] = dataclasses.field(default_factory=list)  # the app, its dir, limits


@message("spawn", PLACEMENT)
class Spawn(Message):
    """Launcher -> driver: start a worker (`cwd`: the proxy's, if the node has it)."""

    key: int
    argv: list[str]
    env: dict[str, str]
    cwd: str


@message("follow", PLACEMENT)
class FollowWorker(Message):
    """Launcher -> driver: the worker `key` runs in the actor named `actor`, which a driver
    that died started (actors outlive their driver): watch it as one of its own. Its
    exit comes as `exited` (at once, when the actor is gone)."""

    key: int
    actor: str


@message("find", PLACEMENT)
class FindWorkers(Message):
    """Launcher -> driver: which workers' actors a predecessor of this gym-proxy (the same
    runtime directory) left alive; answered by `found`."""


@message("stop_all", PLACEMENT)
class StopWorkers(Message):
    """Launcher -> driver: gym-proxy stops for good: kill every actor, then end (stdin's
    end without it is gym-proxy's death, after which actors are kept for `keep_for`)."""


@message("signal", PLACEMENT)
class SignalWorker(Message):
    key: int
    signal: int


@message("kill", PLACEMENT)
class KillWorker(Message):
    """Launcher -> driver: kill the worker's actor; the driver reports it exited."""

    key: int


@message("ready", PLACEMENT)
class DriverReady(Message):
    """Driver -> launcher: it joined the cluster, whose `nodes` have `room` for workers
    now, and room for `most` once Ray's autoscaler has grown it to the bound it reports
    (-1: it reports none, as a fixed cluster or autoscaler v1 do)."""

    nodes: int
    room: int
    most: int = -1


@message("failed", PLACEMENT)
class DriverFailed(Message):
    """Driver -> launcher: it cannot place the workers (one line for the user); it exits."""

    error: str


@message("started", PLACEMENT)
class WorkerStarted(Message):
    """Driver -> launcher: the worker `key` runs as `pid` in the actor named `actor` on Ray
    node `node_id` (`hostname`), its port at `host`:`port`, or at the Unix socket `path`
    on gym-proxy's own node ("" elsewhere)."""

    key: int
    actor: str
    pid: int
    host: str
    port: int
    path: str
    node_id: str
    hostname: str


@message("found", PLACEMENT)
class FoundWorkers(Message):
    """Driver -> launcher: the names of the actors `find` asked for (each followed next,
    `follow`, which answers `started` with where its worker listens)."""

    actors: list[str]


@message("not_started", PLACEMENT)
class NotStarted(Message):
    """Driver -> launcher: the worker `key` did not start (`lost`: its actor died first,
    its node likely gone, so the launcher places it again)."""

    key: int
    error: str
    lost: bool = False


@message("exited", PLACEMENT)
class WorkerExited(Message):
    """Driver -> launcher: the worker `key` exited with `code` (EXIT_UNKNOWN, and `why`,
    when its actor died)."""

    key: int
    code: int
    why: str = ""

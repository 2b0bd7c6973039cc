"""The one configuration object; the command line is derived from its fields."""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any, NoReturn

from gym_proxy.coordinator.contract.ids import is_checkpoint_id
from gym_proxy.coordinator.contract.nemo_gym_env import CONFIG_PATH_ENV

__all__ = [
    "Config",
    "ConfigError",
    "build_parser",
    "config_from_args",
    "read_secret_file",
    "secrets_on_command_line",
    "DEFAULT_APP",
    "SECRET_ENV",
    "metrics_address",
    "MAX_WORKERS",
]

DEFAULT_APP = "gym_proxy.worker.counter:create_app"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# How long workers wait for a successor when gym-proxy dies, unless --orphan-grace says:
# long enough for a supervisor's restart (systemd's RestartSec is 100 ms by default,
# supervisord backs off a few seconds) and an adoption (0.3 s), short enough that idle
# workers of a proxy nobody restarts do not linger (docs/operations.md). The whole rule:
# `Config.settle_orphan_grace`.
DEFAULT_ORPHAN_GRACE = 30.0
PLACEMENTS = ("local", "ray")
# The most workers one server may have, however the count comes (a flag, the config
# block, a resize, a predecessor's fleet.json): a slot holds a process, sockets and
# descriptors, and a count past this is a typo, not a plan.
MAX_WORKERS = 256
COOKIE_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}\Z")  # an RFC 6265 token
# The options that take a number of a kind (`Config.validate`).
_NON_NEGATIVE = (
    "graceful_timeout",
    "upstream_timeout",
    "keepalive_timeout",
    "header_timeout",
    "boot_timeout",
    "lease_grace",
    "session_idle_ttl",
    "max_requests",
    "max_requests_jitter",
    "max_worker_memory",
    "rebalance_cooldown",
    "scale_up_busy",
    "scale_down_busy",
    "scale_up_after",
    "scale_down_after",
    "placement_wait",
)
# Options that act only with another: (what it needs, as the refusal names it; whether
# the config has it). `Config._validate_needs`.
_NEEDS: dict[str, tuple[str, Callable[[Config], bool]]] = {
    **{
        name: ("--max-workers", lambda c: c.max_workers > 0)
        for name in ("min_workers", "scale_up_busy", "scale_up_after", "scale_down_busy",
                     "scale_down_after")
    },
    **{
        name: ("--rebalance", lambda c: c.rebalance)
        for name in ("rebalance_ratio", "stall_threshold", "rebalance_cooldown",
                     "rebalance_max_moves")
    },
    **{
        name: ("--worker-placement ray", lambda c: c.worker_placement == "ray")
        for name in ("worker_cpus", "worker_resources", "worker_strategy", "placement_wait",
                     "local_workers")
    },
}  # fmt: skip
_POSITIVE = ("worker_timeout", "tunnel_idle_timeout", "stall_threshold", "rebalance_max_moves")
_AT_LEAST = (("limit_request_line", 64), ("limit_request_headers", 256), ("max_connections", 1))


class ConfigError(ValueError):
    """A configuration value that cannot work; the message is one line for the user."""


def option(
    default: Any,
    help: str,
    *,
    type: Any = str,
    env: str | None = None,
    positional: bool = False,
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    flag: bool = False,
    doc: str | None = None,
    doc_default: str | None = None,
) -> Any:
    """A Config field that is also a command-line option.

    `help` is the one line `--help` prints; `doc` is the reference text of docs/cli.md
    (Markdown, links relative to docs/; default: `help`) and `doc_default` its default
    column where the value alone does not say it (default: the value, and the env
    variable). `python -m gym_proxy.proxy.cli_reference` renders the table from these."""
    return field(
        default=default,
        metadata={
            "help": help,
            "type": type,
            "env": env,
            "positional": positional,
            "choices": choices,
            "metavar": metavar,
            "flag": flag,
            "doc": doc,
            "doc_default": doc_default,
        },
    )


@dataclass(frozen=True)
class Config:
    """Everything gym-proxy and its workers are started with."""

    app: str = option(
        DEFAULT_APP,
        "the server as module:attr: an aiohttp Application, an ASGI app, a factory "
        "returning either (async factories are awaited), or a NeMo Gym server class",
        positional=True,
        metavar="APP",
        doc="`module:attr` of the app (aiohttp or ASGI), of a factory, or of a NeMo Gym "
        "server class",
        doc_default="`gym_proxy.worker.counter:create_app`; started by NeMo Gym's launcher: "
        "the server class of its `app.py`",
    )
    workers: int = option(
        1,
        "number of worker processes",
        type=int,
        env="GYM_PROXY_WORKERS",
        metavar="N",
        doc="worker processes",
        doc_default="the NeMo Gym instance's `num_workers`, else 1",
    )
    worker_placement: str = option(
        "local",
        "where the workers run: local (processes of this machine) or ray (each on a node of "
        "the server's Ray cluster, placed by Ray)",
        choices=PLACEMENTS,
        metavar="WHERE",
        doc="`local`: the workers are processes of this machine; `ray`: each runs on a node of "
        "the server's Ray cluster, in a Ray actor, reached over an authenticated link "
        "(TCP; a Unix socket on gym-proxy's own node) ([Workers on a Ray cluster](ray.md))",
    )
    worker_cpus: float = option(
        1.0,
        "with --worker-placement ray: CPUs Ray reserves for each worker",
        type=float,
        metavar="N",
        doc="with `--worker-placement ray`: the CPUs Ray reserves for each worker's actor",
    )
    worker_resources: str | None = option(
        None,
        "with --worker-placement ray: more Ray resources each worker needs, as a JSON object "
        "(e.g. '{\"sandbox\": 1}')",
        metavar="JSON",
        doc="with `--worker-placement ray`: more Ray resources each worker needs, a JSON "
        "object of name to amount: `GPU`, or a custom resource (`'{\"sandbox\": 1}'`)",
        doc_default="none",
    )
    worker_strategy: str = option(
        "spread",
        "with --worker-placement ray: spread (over the nodes, Ray's SPREAD) or default (Ray's "
        "DEFAULT: fill nodes in turn)",
        choices=("spread", "default"),
        metavar="S",
        doc="with `--worker-placement ray`: Ray's scheduling strategy for the workers' actors: "
        "`spread` (SPREAD, over the nodes) or `default` (DEFAULT)",
    )
    local_workers: int = option(
        0,
        "with --worker-placement ray: the first N workers are processes of this machine, "
        "the others placed",
        type=int,
        metavar="N",
        doc="with `--worker-placement ray`: the first N slots' workers are processes of this "
        "machine and the others placed: one server across both, moves, rebalance and "
        "restore included; a resize adds and removes placed ones "
        "([Local and placed workers in one server](ray.md#local-and-placed-workers-in-one-server))",
    )
    placement_wait: float = option(
        300.0,
        "with --worker-placement ray: seconds a worker that does not fit yet waits for the "
        "cluster to grow before it is given up",
        type=float,
        metavar="S",
        doc="with `--worker-placement ray`: how long a worker that does not fit on the cluster "
        "yet waits for it to grow (Ray's autoscaler adds a node for its pending actor); past "
        "it, the start, resize or restart that asked for it says so ([Ray](ray.md))",
    )
    host: str = option(
        "127.0.0.1",
        "address of the public port",
        metavar="HOST",
        doc="public address",
        doc_default="the NeMo Gym instance's, else `127.0.0.1`",
    )
    port: int = option(
        8000,
        "public port (0 picks a free one)",
        type=int,
        metavar="PORT",
        doc="public port; `--port 0` picks a free port. Bound at start (a port in use fails "
        "before any worker starts), listening once every worker has registered",
        doc_default="the NeMo Gym instance's, else 8000",
    )
    fd: int | None = option(
        None,
        "serve on this already-bound listening socket file descriptor",
        type=int,
        metavar="FD",
        doc="serve on an inherited, already-bound listening socket (systemd, tests); it serves "
        "from the start, answering 503 `worker_unavailable` until every worker has registered",
    )
    app_dir: str = option(
        ".",
        "directory put first on sys.path to import APP",
        metavar="DIR",
        doc="put first on `sys.path` to import `APP`",
    )
    runtime_dir: str | None = option(
        None,
        "parent directory for the private 0700 runtime directory (default: the system temp dir)",
        env="GYM_PROXY_RUNTIME_DIR",
        metavar="DIR",
        doc="parent of the private 0700 runtime directory; created (0700) if missing; at most "
        "65 bytes (socket paths must fit `sockaddr_un`). Runtime directories of dead instances "
        "(kill -9) under it are removed at start",
        doc_default="system temp",
    )
    secret: str | None = option(
        None,
        "secret that signs session tokens; set it so cookies survive a restart "
        "(prefer --secret-file: a flag is visible in the process list)",
        env="GYM_PROXY_SECRET",
        metavar="S",
        doc="signs session tokens; without one, cookies do not survive a restart (a warning "
        "says so)",
        doc_default="random",
    )
    secret_file: str | None = option(
        None,
        "read the session-token secret from this file (surrounding whitespace ignored)",
        metavar="F",
        doc="read the token secret from a file (prefer this: a `--secret` flag is visible in "
        "the process list, and gym-proxy warns about it)",
    )
    graceful_timeout: float = option(
        30.0,
        "seconds in-flight requests get to finish on SIGTERM/SIGINT",
        type=float,
        metavar="S",
        doc="on SIGTERM/SIGINT, time in-flight requests get to finish",
    )
    # None until settled (`settle_orphan_grace`): a Config built from the command line
    # always has the number.
    orphan_grace: float | None = option(
        None,
        "seconds a worker whose gym-proxy died keeps its sessions, waiting for a gym-proxy "
        "started again with the same command and --runtime-dir to adopt it (0: it stops; "
        f"default: {DEFAULT_ORPHAN_GRACE:g} with a secret, 0 without one or when started by "
        "NeMo Gym's launcher)",
        type=float,
        metavar="S",
        doc="a worker whose gym-proxy died (kill -9, OOM) keeps its sessions this long, "
        "waiting for the same command, started again with the same `--runtime-dir`, to adopt "
        "it (needs a secret, which a successor verifies the tokens with; 0 = it stops at "
        "once; [When gym-proxy dies](operations.md#when-gym-proxy-dies))",
        doc_default=f"{DEFAULT_ORPHAN_GRACE:g} with a secret; 0 without one, and 0 when started "
        "by NeMo Gym's launcher, which restarts no server that dies "
        "([Started by NeMo Gym's launcher](nemo_gym.md#started-by-nemo-gyms-launcher))",
    )
    take_over: bool = option(
        False,
        "start beside a running gym-proxy of the same command and take over its port and "
        "its workers (an upgrade: needs --orphan-grace)",
        type=bool,
        flag=True,
        doc="start beside the running gym-proxy of the same command (same `--runtime-dir`, "
        "instance and secret) and take over its listening socket and its workers, every "
        "session kept; the old one finishes its connections' requests and exits "
        "([Upgrading gym-proxy](operations.md#upgrading-gym-proxy))",
    )
    upstream_timeout: float = option(
        3600.0,
        "seconds without a byte from the worker before a request fails with 504 (0: never)",
        type=float,
        metavar="S",
        doc="no byte from the worker for this long: 504 (0 = never; control calls are bounded "
        "by their own `deadline_ts` instead)",
    )
    keepalive_timeout: float = option(
        75.0,
        "seconds an idle client keep-alive connection is kept open",
        type=float,
        metavar="S",
        doc="idle client keep-alive connections are closed after this",
    )
    header_timeout: float = option(
        10.0,
        "seconds a client gets to send a complete request head (408 after; 0: never)",
        type=float,
        metavar="S",
        doc="a request head must be complete this long after its first byte (or after the "
        "connection opened): 408, or a silent close if nothing came (0 = never)",
    )
    tunnel_idle_timeout: float = option(
        600.0,
        "seconds a WebSocket (or other upgraded) tunnel may pass no byte either way before "
        "both sides are closed",
        type=float,
        metavar="S",
        doc="a WebSocket (or other upgraded) tunnel that passes no byte either way for this "
        "long is closed on both sides",
    )
    limit_request_line: int = option(
        8190,
        "longest request line (method, target, version) in bytes; 414 above",
        type=int,
        metavar="N",
        doc="longest request target in bytes: 414 above",
    )
    limit_request_headers: int = option(
        65536,
        "largest request header block in bytes; 431 above",
        type=int,
        metavar="N",
        doc="largest request header block in bytes: 431 above (a header that never ends is "
        "cut off one read past it). Workers take whatever passes both limits: an aiohttp "
        "worker's header-line, target and header-count limits, and `websockets`' for an ASGI "
        "app's WebSocket upgrade, are raised to match",
    )
    max_connections: int | None = option(
        None,
        "open client connections at most; one more is answered 503 and closed "
        "(default: 10000, or what the descriptor limit allows)",
        type=int,
        metavar="N",
        doc="open client connections. At the cap, keep-alive connections idle between requests "
        "are closed first, longest idle first (pooled clients keep more open than they use "
        "after a burst); only when none is idle is a new one answered 503 "
        "`too_many_connections` and closed. The soft descriptor limit is raised to fit (2 per "
        "connection, besides what the metrics port, the control app and the workers are given "
        "ahead: [Metrics](metrics.md#metrics)); an explicit value the hard limit cannot hold is "
        "kept, with a warning",
        doc_default="10000, or what the descriptor limit allows",
    )
    worker_timeout: float = option(
        30.0,
        "a worker that does not answer the supervisor's ping for this long is killed and "
        "restarted (its sessions answer 410)",
        type=float,
        metavar="S",
        doc="a worker that does not answer the supervisor's ping for this long is killed "
        "(SIGKILL) and restarted; its sessions answer 410. One silent for 2 ping intervals "
        "gets no new sessions",
    )
    metrics: str | None = option(
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics (PORT alone: on --host; "
        "port 0 picks a free one); unset, nothing listens for them",
        env="GYM_PROXY_METRICS",
        metavar="HOST:PORT",
        doc="serve Prometheus `/metrics` on this address (`PORT` alone: on `--host`; port 0 "
        "picks one, and the log says which); unset, nothing listens. At most 16 connections, "
        "bounded by `--header-timeout` and `--keepalive-timeout` like the public port's "
        "([Metrics](metrics.md#metrics))",
        doc_default="unset",
    )
    trace_requests: bool = option(
        False,
        "with NeMo Gym's telemetry on (NEMO_GYM_OTEL_ENABLED), a span per request in the "
        "proxy too (off: they cost on the hot path)",
        type=bool,
        flag=True,
        doc="with NeMo Gym's telemetry on, a span per request in the proxy too "
        "([Traces](metrics.md#traces-opentelemetry-nemo-gyms-conventions))",
    )
    preload: bool = option(
        False,
        "import the app once, in a process each worker is forked from: a worker starts "
        "without importing it again (a NeMo Gym server module: 3.5-5 s of CPU)",
        type=bool,
        flag=True,
        doc="import the app once, in a process each worker is forked from (gunicorn's "
        "`--preload`): a boot, a replacement, a restart or a resize does not import it "
        "again ([Preloading the app](operations.md#preloading-the-app))",
    )
    max_requests: int = option(
        0,
        "recycle a worker after it served this many requests: a rolling restart of that "
        "one worker, its sessions moved to the replacement (0: never)",
        type=int,
        metavar="N",
        doc="recycle a worker after it served N requests: a rolling restart of that worker, "
        "its sessions moved to the replacement ([Live operations](live_operations.md))",
        doc_default="0 (never)",
    )
    max_requests_jitter: int = option(
        0,
        "add a random 0..N to each worker's --max-requests, so workers do not recycle together",
        type=int,
        metavar="N",
        doc="add a random 0..N to each worker's `--max-requests`",
    )
    max_worker_memory: float = option(
        0.0,
        "recycle a worker whose resident memory (RSS) exceeds this many MiB, as "
        "--max-requests does (0: never)",
        type=float,
        metavar="MIB",
        doc="recycle a worker whose resident memory exceeds this",
        doc_default="0 (never)",
    )
    rebalance: bool = option(
        False,
        "move idle sessions off a worker that is hot against the others or whose event "
        "loop stalls, to the least loaded workers (off: a session stays where it started)",
        type=bool,
        flag=True,
        doc="move idle sessions off a hot or stalled worker to the least loaded ones, with "
        "the moves a drain uses ([Rebalancing](operations.md#rebalancing))",
    )
    rebalance_ratio: float = option(
        2.0,
        "with --rebalance: a worker is hot when it runs this many times the requests the "
        "others typically run (and at least 2), or its loop is as many times later, for 3 s; "
        "0: only a stalled worker sheds",
        type=float,
        metavar="X",
        doc="with `--rebalance`: a worker is hot when its average requests in flight reach "
        "this many times what the other workers typically run (their median, and at least "
        "2), or its event loop's delay this many times theirs (and at least 50 ms), for 3 s; "
        "0 turns the hot rule off (only a stalled worker sheds)",
    )
    stall_threshold: float = option(
        1.0,
        "with --rebalance: a worker whose event loop answers this many seconds late is "
        "stalled: no new sessions, and its idle ones move",
        type=float,
        metavar="S",
        doc="with `--rebalance`: a worker whose event loop answers the supervisor's ping "
        "this late is stalled: it gets no new sessions and sheds its idle ones",
    )
    rebalance_cooldown: float = option(
        10.0,
        "with --rebalance: seconds a worker that took sessions is left alone (a moved "
        "session stays 3 times as long)",
        type=float,
        metavar="S",
        doc="with `--rebalance`: seconds a worker that took sessions is left alone, and "
        "three times that a moved session stays where it went (so nothing flaps)",
    )
    rebalance_max_moves: float = option(
        10.0,
        "with --rebalance: sessions moved per second at most, over the whole server",
        type=float,
        metavar="N",
        doc="with `--rebalance`: sessions moved per second at most, over the whole server",
    )
    min_workers: int = option(
        1,
        "with --max-workers: the fewest workers the autoscaler shrinks to",
        type=int,
        metavar="N",
        doc="with `--max-workers`: the fewest workers the autoscaler shrinks to",
    )
    max_workers: int = option(
        0,
        "the worker count follows demand between --min-workers and this (0: fixed at "
        "--workers): one more when every worker is busy, one less when all are idle",
        type=int,
        metavar="N",
        doc="the worker count follows demand between `--min-workers` and this: a worker "
        "more when every worker is busy for a while, one less (drained, its sessions "
        "moved) when all stay idle ([The worker count follows demand](operations.md#the-"
        "worker-count-follows-demand))",
        doc_default="0 (a fixed count)",
    )
    scale_up_busy: float = option(
        4.0,
        "with --max-workers: grow when every worker runs this many requests on average",
        type=float,
        metavar="N",
        doc="with `--max-workers`: grow when every worker runs at least this many requests "
        "on average (or is stalled) for `--scale-up-after`",
    )
    scale_up_after: float = option(
        10.0,
        "with --max-workers: seconds every worker must stay busy before a grow",
        type=float,
        metavar="S",
        doc="with `--max-workers`: seconds every worker must stay busy before a grow",
    )
    scale_down_busy: float = option(
        0.5,
        "with --max-workers: shrink when every worker runs fewer requests than this",
        type=float,
        metavar="N",
        doc="with `--max-workers`: shrink when every worker runs fewer requests than this "
        "on average for `--scale-down-after`",
    )
    scale_down_after: float = option(
        60.0,
        "with --max-workers: seconds every worker must stay idle before a shrink",
        type=float,
        metavar="S",
        doc="with `--max-workers`: seconds every worker must stay idle before a shrink",
    )
    session_idle_ttl: float = option(
        0.0,
        "end sessions unused for this many seconds in the workers' session stores (0: never)",
        type=float,
        metavar="S",
        doc="workers end sessions unused for this long (not while a checkpoint is open, not "
        "while a request of theirs runs)",
        doc_default="0 (never)",
    )
    boot_timeout: float = option(
        60.0,
        "seconds the workers get to start and register",
        type=float,
        metavar="S",
        doc="all workers must register within this at start",
    )
    backlog: int = option(
        2048, "listen backlog of the public port", type=int, metavar="N", doc="listen backlog"
    )
    control_token: str | None = option(
        None,
        "bearer token for /ng-control/ checkpoint calls; unset, the server is not a participant "
        "(prefer --control-token-file)",
        env="GYM_PROXY_CONTROL_TOKEN",
        metavar="T",
        doc="bearer token of the checkpoint control plane; unset, `/ng-control/` answers 404 "
        "and the server is not a participant. Needs a secret",
        doc_default="unset",
    )
    control_token_file: str | None = option(
        None,
        "read the control token from this file (surrounding whitespace ignored)",
        metavar="F",
        doc="read the control token from a file",
    )
    name: str | None = option(
        None,
        "instance name: checkpoints are filed under it, and it names the session cookie and "
        "tags the tokens, so two servers of one stack must not share it (default: the APP "
        "module's last name)",
        metavar="NAME",
        doc="instance name: checkpoints are filed under it, the cookie is named after it and "
        "tokens carry its tag, so the servers of one stack must not share one",
        doc_default="the NeMo Gym instance, else the APP module's last name",
    )
    cookie_name: str | None = option(
        None,
        "name of the session cookie (default: gym_proxy___<instance name>)",
        metavar="NAME",
        doc="the session cookie's name",
        doc_default="`gym_proxy___<instance name>`",
    )
    nemo_gym_config: str | None = option(
        None,
        "a NeMo Gym server class's global config file (YAML, parsed by NeMo Gym); default: "
        "the config NeMo Gym's launcher passes (NEMO_GYM_CONFIG_DICT). Its instance "
        "(--name, else NEMO_GYM_CONFIG_PATH, else the only one of the class) gives host, "
        "port and --workers unless a flag does",
        metavar="F",
        doc="a NeMo Gym global config (YAML), for a NeMo Gym server class `APP` (see "
        "[Running a NeMo Gym server](nemo_gym.md))",
        doc_default="the launcher's `NEMO_GYM_CONFIG_DICT`",
    )
    session_state: str | None = option(
        None,
        "attribute of a NeMo Gym server holding per-session state in a dict keyed by NeMo "
        "Gym's session ID (e.g. session_id_to_counter): each session's entry is exported, "
        "restored, retired and released with it (otherwise the server is restart-only)",
        env="GYM_PROXY_SESSION_STATE",
        metavar="ATTR",
        doc="the NeMo Gym server's attribute holding per-session state in a dict keyed by its "
        "session ID; without it (and without hooks) the server is restart-only",
    )
    kind: str | None = option(
        None,
        "participant kind: resources, agent, environment or model (default: what the app "
        "declares, else resources)",
        choices=("resources", "agent", "environment", "model"),
        metavar="K",
        doc="participant kind: `resources`, `agent`, `environment`, `model`",
        doc_default="what the app (or NeMo Gym class) declares, else `resources`",
    )
    lease_grace: float = option(
        600.0,
        "seconds past the last deadline_ts before an open checkpoint resumes itself",
        type=float,
        metavar="S",
        doc="an open checkpoint resumes itself this long after its last `deadline_ts`",
    )
    log_level: str = option(
        "info",
        "log level: critical, error, warning, info or debug",
        choices=LOG_LEVELS,
        metavar="L",
        doc="`critical`, `error`, `warning`, `info`, `debug`",
    )
    access_log: bool = option(
        False,
        "log one line per request to the gym_proxy.access logger (costs data-path CPU)",
        type=bool,
        flag=True,
        doc='one line per request (`client "METHOD path HTTP/v" status time worker=<slot>`), '
        "logger `gym_proxy.access`; 499 marks a client that went away, `worker=-` an answer of "
        "the proxy's own. Each worker logs its own too (`worker <slot> <path> <status> "
        "session=<app session>`, logger `gym_proxy.worker.access`): which worker served which "
        "session",
    )
    # The fields the command line (or an environment variable) set: a NeMo Gym config
    # fills the others (host, port, workers, name).
    given: frozenset[str] = field(default=frozenset(), metadata={"internal": True})
    # Of those, the ones only an environment variable set: a server's `gym_proxy:` block
    # in the NeMo Gym config overrides them (proxy/config_block.py), a flag it does not.
    from_env: frozenset[str] = field(default=frozenset(), metadata={"internal": True})
    # Started by NeMo Gym's launcher, which names the server it starts in the environment
    # (read by config_from_args, before gym-proxy sets that variable for its own workers).
    by_nemo_gym_launcher: bool = field(default=False, metadata={"internal": True})

    def settle_orphan_grace(self) -> Config:
        """This config with `--orphan-grace` settled: as given, else the default, the one
        place it is decided (docs/cli.md states it). 0 when started by NeMo Gym's launcher:
        it restarts no server that dies, so nothing would adopt the workers (and, waiting,
        they would hold its output). Otherwise DEFAULT_ORPHAN_GRACE with a secret, 0
        without one: no successor could verify the workers' tokens. Run by whatever builds
        the config (config_from_args, and apply_block, whose `secret_file` may bring the
        secret), so every later reader sees the number."""
        if "orphan_grace" in self.given:
            return self
        if self.by_nemo_gym_launcher or self.secret is None:
            return replace(self, orphan_grace=0.0)
        return replace(self, orphan_grace=DEFAULT_ORPHAN_GRACE)

    def settle_workers(self) -> Config:
        """With autoscaling (`--max-workers`) and no `--workers`, the count it starts with
        is `--min-workers` (the default 1 would lie under a larger minimum)."""
        if self.max_workers and "workers" not in self.given and self.workers < self.min_workers:
            return replace(self, workers=self.min_workers)
        return self

    def validate(self) -> None:
        """Raise ConfigError for values that cannot work."""
        # A given 0 only: a settled one may still change with a secret the NeMo Gym
        # config's block brings, and startup checks the final one.
        if self.take_over and "orphan_grace" in self.given and self.orphan_grace == 0:
            raise ConfigError(
                "--take-over needs --orphan-grace above 0: the workers change proxies"
            )
        self._validate_placement()
        self._validate_numbers()
        self._validate_needs()
        if self.metrics is not None:
            metrics_address(self.metrics, self.host)  # raises ConfigError when malformed
        if ":" not in self.app:
            raise ConfigError(f"APP must look like module:attr, got {self.app!r}")
        self._validate_names()

    def _validate_numbers(self) -> None:
        """Counts, ports, times and ratios within their bounds."""
        for name in ("workers", "min_workers", "max_workers"):
            value, least = getattr(self, name), 0 if name == "max_workers" else 1
            if not least <= value <= MAX_WORKERS:
                flag = name.replace("_", "-")
                raise ConfigError(f"--{flag} must be {least}-{MAX_WORKERS}, got {value}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be between 0 and 65535, got {self.port}")
        for name in _NON_NEGATIVE:
            if not 0 <= getattr(self, name) < float("inf"):
                raise ConfigError(f"--{name.replace('_', '-')} must be a non-negative number")
        if self.orphan_grace is not None and not 0 <= self.orphan_grace < float("inf"):
            raise ConfigError("--orphan-grace must be a non-negative number")
        if self.max_workers and self.min_workers > self.max_workers:
            raise ConfigError(
                f"--min-workers {self.min_workers} is over --max-workers {self.max_workers}"
            )
        if self.max_workers and not self.min_workers <= self.workers <= self.max_workers:
            raise ConfigError(
                f"--workers {self.workers} must lie within --min-workers {self.min_workers} "
                f"and --max-workers {self.max_workers}"
            )
        if not self.scale_down_busy < self.scale_up_busy:
            raise ConfigError("--scale-down-busy must be under --scale-up-busy")
        if not (self.rebalance_ratio > 1 or self.rebalance_ratio == 0):
            raise ConfigError(
                "--rebalance-ratio must be over 1 (a worker hot against itself), or 0 (off)"
            )
        for name in _POSITIVE:
            if not 0 < getattr(self, name) < float("inf"):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number")
        for name, least in _AT_LEAST:
            value = getattr(self, name)
            if value is not None and value < least:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least {least}")

    def _validate_names(self) -> None:
        """Secrets, the instance name and the cookie name."""
        if self.secret is not None and not self.secret:
            raise ConfigError("--secret must not be empty")
        if self.control_token is not None and not self.control_token:
            raise ConfigError("--control-token must not be empty")
        if self.control_token and self.secret is None:
            raise ConfigError(
                "--control-token needs --secret-file (or --secret): restored sessions "
                "must be verified with the same secret after a restart"
            )
        if self.name is not None and not is_checkpoint_id(self.name):
            raise ConfigError("--name must be 1-128 characters of A-Z a-z 0-9 . _ -")
        if self.cookie_name is not None and not COOKIE_NAME.match(self.cookie_name):
            raise ConfigError(
                "--cookie-name must be 1-128 cookie-name characters "
                "(A-Z a-z 0-9 ! # $ % & ' * + - . ^ _ ` | ~)"
            )

    def _validate_needs(self) -> None:
        """An option that acts only with another is refused without it (one line naming
        the missing one), instead of being accepted and doing nothing."""
        for name, (needed, on) in _NEEDS.items():
            if name in self.given and not on(self):
                raise ConfigError(f"--{name.replace('_', '-')} needs {needed}")

    def _validate_placement(self) -> None:
        if self.worker_placement != "ray":
            return
        if not 0 <= self.worker_cpus < float("inf"):
            raise ConfigError("--worker-cpus must be a non-negative number")
        if not 0 <= self.local_workers <= self.workers:
            raise ConfigError(
                f"--local-workers {self.local_workers} must lie within 0 and --workers "
                f"{self.workers}"
            )
        self.ray_resources()  # raises ConfigError when malformed

    @property
    def room_wait(self) -> float:
        """How long a worker may wait for room before it starts: a placed one for the Ray
        cluster to grow (--placement-wait), a local one not at all."""
        return self.placement_wait if self.worker_placement == "ray" else 0.0

    def ray_resources(self) -> dict[str, float]:
        """`--worker-resources` as Ray takes it: name -> amount."""
        if self.worker_resources is None:
            return {}
        try:
            value = json.loads(self.worker_resources)
        except ValueError:
            value = None
        if not isinstance(value, dict) or not all(
            isinstance(amount, int | float) and not isinstance(amount, bool) and amount >= 0
            for amount in value.values()
        ):
            raise ConfigError(
                "--worker-resources must be a JSON object of resource name to a non-negative "
                f"amount, got {self.worker_resources!r}"
            )
        if "CPU" in value:
            raise ConfigError("--worker-resources: a worker's CPUs are --worker-cpus")
        return {str(name): float(amount) for name, amount in value.items()}

    @property
    def instance(self) -> str:
        """The instance name checkpoints are filed under."""
        return self.name or self.app.partition(":")[0].rsplit(".", 1)[-1]

    @property
    def session_cookie(self) -> str:
        """This instance's cookie, named after it as NeMo Gym names its servers' cookies
        (`<Class>___<instance>`): cookies travel between the servers of a stack."""
        return self.cookie_name or f"gym_proxy___{self.instance}"


def _version() -> str:
    try:
        return importlib.metadata.version("gym-proxy")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


# What users of gunicorn and uvicorn type first, and what gym-proxy takes instead.
_HINTS = {
    "-w": "use --workers N (gunicorn's -w)",
    "--bind": "use --host H --port P (gunicorn's --bind)",
    "-b": "use --host H --port P (gunicorn's -b)",
    "--timeout": "use --worker-timeout S for a silent worker, --graceful-timeout S for a "
    "stop (gunicorn's --timeout)",
    "-t": "use --worker-timeout S (gunicorn's -t)",
    "--factory": "no flag is needed: APP may name a factory, which gym-proxy calls "
    "(uvicorn's --factory)",
    "--reload": "there is no reload: a rolling restart (SIGHUP, or the restart call) loads "
    "new code without losing a session",
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with a mistake said in one line: its usage is 28 lines, the one
    that matters last (`--help` shows the usage); a flag of gunicorn's or uvicorn's is
    answered with gym-proxy's own."""

    def error(self, message: str) -> NoReturn:
        words = message.partition(":")[2].split() if message.startswith("unrecognized") else []
        hints = [f"for {word} {_HINTS[word]}" for word in words if word in _HINTS]
        flags = [f for action in self._actions for f in action.option_strings if len(f) > 2]
        for word in words:  # a typo: the flag it most likely meant
            near = difflib.get_close_matches(word.partition("=")[0], flags, n=1, cutoff=0.8)
            if word not in _HINTS and near:
                hints.append(f"did you mean {near[0]}?")
        if hints:
            message = f"{message}; {'; '.join(hints)}"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# `--help` in sections, as gunicorn's settings are: every option in one (a fast test).
HELP_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("the app and its workers", ("app", "workers", "app_dir", "preload", "kind",
     "session_state", "nemo_gym_config", "name", "boot_timeout", "worker_timeout")),
    ("where it listens", ("host", "port", "fd", "backlog", "max_connections", "cookie_name",
     "runtime_dir")),
    ("secrets, control and what it tells", ("secret", "secret_file", "control_token",
     "control_token_file", "metrics", "trace_requests", "log_level", "access_log")),
    ("timeouts and limits", ("graceful_timeout", "upstream_timeout", "keepalive_timeout",
     "header_timeout", "tunnel_idle_timeout", "limit_request_line", "limit_request_headers",
     "session_idle_ttl", "lease_grace")),
    ("when gym-proxy dies or is upgraded", ("orphan_grace", "take_over")),
    ("recycling a worker", ("max_requests", "max_requests_jitter", "max_worker_memory")),
    ("rebalancing (with --rebalance)", ("rebalance", "rebalance_ratio", "stall_threshold",
     "rebalance_cooldown", "rebalance_max_moves")),
    ("the worker count follows demand (with --max-workers)", ("max_workers", "min_workers",
     "scale_up_busy", "scale_up_after", "scale_down_busy", "scale_down_after")),
    ("workers on a Ray cluster (with --worker-placement ray)", ("worker_placement",
     "worker_cpus", "worker_resources", "worker_strategy", "local_workers",
     "placement_wait")),
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """An argument parser with one option per Config field, in HELP_GROUPS' sections."""
    parser = _Parser(
        prog="gym-proxy",
        usage="gym-proxy [OPTIONS] [APP]",
        description="Run one stateful environment server as N workers behind one port.",
    )
    parser.add_argument("--version", action="version", version=f"gym-proxy {_version()}")
    items = {item.name: item for item in fields(Config)}
    for title, names in HELP_GROUPS:
        group = parser.add_argument_group(title)
        for name in names:
            _add_option(group, items[name])
    return parser


def _add_option(group: argparse._ArgumentGroup, item: Field[Any]) -> None:
    meta = item.metadata
    help_text = meta["help"]
    if meta["env"]:
        help_text += f" [env {meta['env']}]"
    if item.default is not MISSING and item.default is not None and not meta["flag"]:
        help_text += f" (default: {item.default})"
    kwargs: dict[str, Any] = {"help": help_text, "default": None}
    if meta["flag"]:
        kwargs["action"] = "store_true"
    elif meta["choices"]:
        kwargs["choices"] = meta["choices"]
    else:
        kwargs["type"] = meta["type"]
    if meta["metavar"]:
        kwargs["metavar"] = meta["metavar"]
    if meta["positional"]:
        group.add_argument(item.name, nargs="?", **kwargs)
    else:
        group.add_argument("--" + item.name.replace("_", "-"), dest=item.name, **kwargs)


def read_secret_file(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            value = handle.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {path}: {getattr(exc, 'strerror', None) or exc}") from exc
    if not value:
        raise ConfigError(f"{flag} {path} is empty")
    return value


def config_from_args(argv: Sequence[str] | None = None) -> Config:
    """Flags first, then environment variables, then defaults; secret files are read and
    `--orphan-grace` settled."""
    namespace = build_parser().parse_args(argv)
    values: dict[str, Any] = {}
    from_env: set[str] = set()
    for item in fields(Config):
        if item.metadata.get("internal"):
            continue
        value = getattr(namespace, item.name)
        env = item.metadata["env"]
        if value is None and env and os.environ.get(env):
            try:
                value = item.metadata["type"](os.environ[env])
            except ValueError as exc:
                raise ConfigError(f"environment variable {env}: {exc}") from exc
            from_env.add(item.name)
        if value is not None:
            values[item.name] = value
    for name in ("secret", "control_token"):
        path = values.get(f"{name}_file")
        if path is not None:
            flag = f"--{name.replace('_', '-')}"
            if getattr(namespace, name) is not None:
                raise ConfigError(f"{flag} and {flag}-file exclude each other")
            values[name] = read_secret_file(path, f"{flag}-file")
    config = replace(
        Config(),
        **values,
        given=frozenset(values),
        from_env=frozenset(from_env),
        by_nemo_gym_launcher=os.environ.get(CONFIG_PATH_ENV) is not None,
    )
    config = config.settle_workers()
    config.validate()
    return config.settle_orphan_grace()


SECRET_ENV = ("GYM_PROXY_SECRET", "GYM_PROXY_CONTROL_TOKEN")


def secrets_on_command_line(argv: Sequence[str]) -> list[str]:
    """The secret-bearing flags given on the command line (visible in the process list)."""
    flags = ("--secret", "--control-token")
    return [f for f in flags if any(a == f or a.startswith(f + "=") for a in argv)]


def metrics_address(value: str, default_host: str) -> tuple[str, int]:
    """`--metrics` as (host, port): HOST:PORT, [V6]:PORT or PORT."""
    host, sep, port_text = value.rpartition(":")
    if not sep:
        host, port_text = default_host, value
    host = host.strip("[]") or default_host
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"--metrics must be HOST:PORT or PORT, got {value!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"--metrics port must be between 0 and 65535, got {port}")
    return host, port

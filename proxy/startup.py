"""Starting gym-proxy (`proxy.cli` calls `start`): validate everything, bind the port,
then run the server.

Every mistake a user can make on the command line (bad flags, an APP that does not
import, a port in use) ends here with one line on stderr and a non-zero exit, before
any worker starts.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import secrets
import socket
import stat
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import uvloop

from gym_proxy.coordinator.contract.collector import freeze_startup_heap
from gym_proxy.coordinator.contract.exit_codes import RAY_ERROR, exit_process
from gym_proxy.proxy.config import (
    SECRET_ENV,
    Config,
    ConfigError,
    secrets_on_command_line,
)
from gym_proxy.proxy.config_block import apply_block
from gym_proxy.proxy.launch import WorkerPlan
from gym_proxy.proxy.ray_cluster.cluster import RayPlan
from gym_proxy.proxy.runtime_dir import ensure_parent, secret_fingerprint
from gym_proxy.proxy.server import run
from gym_proxy.proxy.take_over import TakeOverError, take_over_running
from gym_proxy.proxy.usage import usage_error
from gym_proxy.worker.app_loading import AppLoadError, import_app_target
from gym_proxy.worker.nemo_gym_server import (
    NemoGymConfigError,
    check_session_state,
    is_server_class,
    launcher_app,
    resolve_instance,
    uses_ray,
)

__all__ = ["start", "bind_listener"]


def bind_listener(config: Config) -> socket.socket:
    """The public socket: an inherited `--fd` (listening), or `--host`/`--port` bound now
    (a port in use fails here, before any worker starts) and listened on once every
    worker has registered (`proxy.server`)."""
    if config.fd is not None:
        sock = socket.socket(fileno=config.fd)
        if not stat.S_ISSOCK(os.fstat(config.fd).st_mode) or sock.type != socket.SOCK_STREAM:
            raise OSError(f"--fd {config.fd} is not a stream socket")
        # Passed down to us inheritable; our workers must not hold the public port.
        os.set_inheritable(config.fd, False)
        sock.listen(config.backlog)
    else:
        infos = socket.getaddrinfo(
            config.host, config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except OSError:
            sock.close()
            raise
    sock.setblocking(False)
    return sock


def _from_nemo_gym_config(config: Config, cls: type) -> tuple[Config, WorkerPlan]:
    """A NeMo Gym server class: its instance in the global config gives the name, host,
    port and worker count not given on the command line; the workers get the config.
    A class that uses Ray (NeMo Gym's rule) gets the plan of its one cluster."""
    instance = resolve_instance(cls, config.nemo_gym_config, config.name)
    config = apply_block(config, instance.gym_proxy_options, instance.options_path)
    given = config.given
    values: dict[str, Any] = {"name": instance.name}
    if instance.host is not None and "host" not in given and "fd" not in given:
        values["host"] = instance.host
    if instance.port is not None and "port" not in given and "fd" not in given:
        values["port"] = instance.port
    if instance.num_workers is not None and "workers" not in given:
        values["workers"] = instance.num_workers
    config = replace(config, **values)
    config.validate()
    environment = instance.environment(config.workers)
    if not uses_ray(cls) and config.worker_placement != "ray":
        return config, WorkerPlan(environment)
    return config, WorkerPlan(environment, cluster_plan(instance.ray_address))


def cluster_plan(config_address: str | None = None) -> RayPlan:
    """The server's one Ray cluster: the one its NeMo Gym config names, else the one
    RAY_ADDRESS names, else a local one gym-proxy starts."""
    if config_address is not None:
        return RayPlan(config_address, "ray_head_node_address in the NeMo Gym config")
    if os.environ.get("RAY_ADDRESS"):
        return RayPlan(os.environ["RAY_ADDRESS"], "RAY_ADDRESS")
    return RayPlan(None)


def start(config: Config, argv: Sequence[str]) -> None:
    """With the command line read (`config`, from `argv`), check the app, bind the port
    and run the server until it stops; exits."""
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s gym-proxy %(levelname)s %(message)s",
    )
    # Read once; workers never see them (they do not need them) and neither does the app
    # imported next, nor anyone reading this process's environment later.
    for name in SECRET_ENV:
        os.environ.pop(name, None)
    config, plan = _the_app(config)
    # A NeMo Gym server's `gym_proxy:` block may set the level too: it holds from here.
    logging.getLogger().setLevel(config.log_level.upper())
    try:
        ensure_parent(config.runtime_dir or tempfile.gettempdir())
    except ValueError as exc:
        usage_error(f"--runtime-dir {config.runtime_dir or tempfile.gettempdir()} {exc}")
    except OSError as exc:
        usage_error(f"--runtime-dir {config.runtime_dir}: {exc.strerror or exc}")
    secret = _secret(config)
    take_over = None
    if config.take_over:
        try:
            fingerprint = secret_fingerprint(secret, config.instance)
            take_over = take_over_running(config.runtime_dir, config.instance, fingerprint)
        except TakeOverError as exc:
            usage_error(f"--take-over: {exc}")
        sock = take_over.listen_sock
        sock.setblocking(False)
    else:
        try:
            sock = bind_listener(config)
        except OSError as exc:
            where = f"fd {config.fd}" if config.fd is not None else f"{config.host}:{config.port}"
            usage_error(f"cannot listen on {where}: {exc.strerror or exc}")
    # Nothing is refused from here: a start that fails says its one line and nothing else.
    _warn_about_secrets(config, argv)
    freeze_startup_heap()  # every module is imported: no full pass walks them again
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        code = runner.run(run(config, sock, secret, plan, take_over=take_over))
    exit_process(code)


def _the_app(config: Config) -> tuple[Config, WorkerPlan]:
    """`APP` imported (or the server NeMo Gym's launcher started in its place), with a
    NeMo Gym class's config settled and the Ray cluster it or the placement needs;
    exits with one line when it cannot be."""
    try:
        if "app" not in config.given:
            launched = launcher_app()  # started by NeMo Gym's launcher in a server's place
            if launched is not None:
                config = replace(config, app=launched[0], app_dir=launched[1])
        target = import_app_target(config.app, config.app_dir)
        plan = WorkerPlan()
        if is_server_class(target):
            config, plan = _from_nemo_gym_config(config, target)
            if config.session_state is not None:
                check_session_state(target, config.session_state)
        elif config.session_state is not None:
            raise ConfigError("--session-state names an attribute of a NeMo Gym server class")
        if config.worker_placement == "ray" and plan.ray is None:
            plan = replace(plan, ray=cluster_plan())
    except (AppLoadError, ConfigError, NemoGymConfigError) as exc:
        usage_error(str(exc))
    if plan.ray is not None and not _has_ray():
        what = "--worker-placement ray" if config.worker_placement == "ray" else "the app"
        print(
            f"gym-proxy: error: {what} needs Ray, which this Python does not have "
            "(pip install 'ray[default]')",
            file=sys.stderr,
        )
        sys.exit(RAY_ERROR)
    return config, plan


def _has_ray() -> bool:
    """Whether Ray imports as gym-proxy's Ray processes import it (`python -P`): a `ray`
    directory in the working directory, such as Ray's own temp dir /tmp/ray, is a
    namespace package to `find_spec`, not Ray."""
    spec = importlib.util.find_spec("ray")
    return spec is not None and spec.origin not in (None, "namespace")


def _warn_about_secrets(config: Config, argv: Sequence[str]) -> None:
    log = logging.getLogger("gym_proxy")
    for flag in secrets_on_command_line(argv):
        log.warning(
            "%s on the command line is visible to every local user; use %s-file", flag, flag
        )
    if config.secret is None:
        log.warning("no --secret: using a random one, so session cookies do not survive a restart")


def _secret(config: Config) -> bytes:
    """The secret sessions are signed with (a random one without --secret, said once the
    start cannot fail on what was given); exits when what needs a secret has none."""
    if config.secret is None and (config.orphan_grace or config.take_over):
        usage_error(
            f"{'--take-over' if config.take_over else '--orphan-grace'} needs --secret or "
            "--secret-file: the workers' sessions outlive gym-proxy only for one that "
            "verifies their tokens, which a random secret cannot"
        )
    if config.take_over and not config.orphan_grace:
        usage_error("--take-over needs --orphan-grace above 0: the workers change proxies")
    if config.secret is None:
        return secrets.token_bytes(32)
    return config.secret.encode()

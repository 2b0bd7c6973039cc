"""A NeMo Gym server class as APP, built exactly as NeMo Gym builds it.

`gym-proxy resources_servers.my_env.app:MyServer --workers 4` names a subclass of NeMo
Gym's `SimpleServer`. Each worker builds it with the class's own
`run_webserver()`, in the mode NeMo Gym itself uses for the processes of
`uvicorn --workers N`: with `IS_NEMO_GYM_FASTAPI_WORKER=1` set, `run_webserver()` builds
the whole app (global config, server client and head server config, session, exception
and cancellation middleware, MCP auto-exposure, liveness routes, telemetry
instrumentation) and returns it instead of running uvicorn; and
`NEMO_GYM_FASTAPI_NUM_WORKERS` sizes each process's share of the connection pool. So
nothing of NeMo Gym's is copied here, and a later NeMo Gym builds its server its way.

The global config comes as NeMo Gym's launcher passes it (`NEMO_GYM_CONFIG_DICT`, the
instance in `NEMO_GYM_CONFIG_PATH`), or from a config file (`--nemo-gym-config`), parsed
by NeMo Gym's own parser; the instance is `--name`, else `NEMO_GYM_CONFIG_PATH`, else the
one instance of the class's server directory in the config. The proxy resolves it once
(`resolve_instance`) and hands it to every worker in those two variables, so all workers
and the proxy agree on it (host, port and worker count come from it unless a flag says
otherwise).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import sys
import typing
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from gym_proxy.coordinator.contract.nemo_gym_env import CONFIG_DICT_ENV, CONFIG_PATH_ENV
from gym_proxy.worker.declaration import Kind, Participation

__all__ = [
    "NemoGymConfigError",
    "NemoGymInstance",
    "build_server_app",
    "check_session_state",
    "nemo_gym_participation",
    "is_server_class",
    "launcher_app",
    "resolve_instance",
    "server_kind",
    "server_of",
    "uses_ray",
    "with_ray_address",
]

RAY_ADDRESS_KEY = "ray_head_node_address"  # NeMo Gym's RAY_HEAD_NODE_ADDRESS_KEY_NAME
# gym-proxy's own settings in a server's block (proxy/config_block.py).
OPTIONS_KEY = "gym_proxy"
WORKER_ENV = "IS_NEMO_GYM_FASTAPI_WORKER"
NUM_WORKERS_ENV = "NEMO_GYM_FASTAPI_NUM_WORKERS"
# NeMo Gym's base classes (matched by name along the MRO, as NeMo Gym's own telemetry
# does) -> the participant kind.
_KINDS: dict[str, Kind] = {
    "SimpleResourcesServer": "resources",
    "SimpleResponsesAPIAgent": "agent",
    "SimpleResponsesAPIModel": "model",
    "BaseEnvironmentServer": "environment",
}


class NemoGymConfigError(ValueError):
    """The NeMo Gym config cannot give this server its instance; one line for the user."""


def is_server_class(target: Any) -> bool:
    """True for a subclass of NeMo Gym's `SimpleServer` (`nemo_gym.server_utils`)."""
    return inspect.isclass(target) and any(
        base.__name__ == "SimpleServer" and base.__module__ == "nemo_gym.server_utils"
        for base in target.__mro__
    )


def server_kind(cls: type) -> Kind | None:
    """The participant kind of a NeMo Gym server class, None if it is none of the four."""
    for base in cls.__mro__:
        kind = _KINDS.get(base.__name__)
        if kind is not None:
            return kind
    return None


@dataclass(frozen=True)
class NemoGymInstance:
    """One server instance of a NeMo Gym global config."""

    name: str
    host: str | None
    port: int | None
    num_workers: int | None
    config: Any  # the whole global config (an OmegaConf DictConfig)
    # The server block's `gym_proxy:` settings (proxy/config_block.py), as plain data.
    gym_proxy_options: Any = None

    @property
    def options_path(self) -> str:
        """Where the `gym_proxy:` settings sit, for errors: `<instance>.<type>.<server>`."""
        (server_type, server_name), _ = _server_block(self.config, self.name)
        return f"{self.name}.{server_type}.{server_name}.{OPTIONS_KEY}"

    @property
    def ray_address(self) -> str | None:
        """The Ray cluster the global config names (NeMo Gym's launcher sets it), if any."""
        address = self.config.get(RAY_ADDRESS_KEY)
        return str(address) if address else None

    def environment(self, workers: int) -> dict[str, str]:
        """What the workers get: the global config, with this instance's `num_workers`
        set to gym-proxy's worker count (NeMo Gym sizes each process's connection pool
        by it), and the instance."""
        from omegaconf import OmegaConf

        config = copy.deepcopy(self.config)
        server = _server_block(config, self.name)[1]
        server["num_workers"] = workers
        if OPTIONS_KEY in server:  # gym-proxy's, not the server class's (which may forbid it)
            del server[OPTIONS_KEY]
        return {CONFIG_DICT_ENV: OmegaConf.to_yaml(config), CONFIG_PATH_ENV: self.name}


def uses_ray(cls: type) -> bool:
    """Whether NeMo Gym's `run_webserver()` initializes Ray for `cls`: NeMo Gym's own rule
    (`ray_enabled`, else on, with NeMo Gym's warning), asked of NeMo Gym itself."""
    from nemo_gym import server_utils

    rule = getattr(server_utils, "_server_uses_ray", None)
    if rule is None:  # a NeMo Gym before the rule had a name: every server used Ray
        return getattr(cls, "ray_enabled", None) is not False
    return bool(rule(cls))


def with_ray_address(config_text: str, address: str) -> str:
    """The global config (YAML, as the workers get it) naming the Ray cluster to join, as
    NeMo Gym's `initialize_ray()` hands it to the processes it starts."""
    from omegaconf import DictConfig, OmegaConf

    config = OmegaConf.create(config_text)
    assert isinstance(config, DictConfig)  # the proxy made it from a mapping
    config[RAY_ADDRESS_KEY] = address
    text: str = OmegaConf.to_yaml(config)
    return text


def resolve_instance(cls: type, config_file: str | None, name: str | None) -> NemoGymInstance:
    """The instance of `cls` in the global config (the launcher's, or `config_file`)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if config_file is not None:
        from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig

        try:
            raw = OmegaConf.load(config_file)
        except (OSError, ValueError) as exc:
            raise NemoGymConfigError(f"--nemo-gym-config {config_file}: {exc}") from exc
        try:
            config = GlobalConfigDictParser().parse(
                GlobalConfigDictParserConfig(
                    initial_global_config_dict=raw, skip_load_from_cli=True
                )
            )
        except Exception as exc:  # NeMo Gym's parser refuses it (its report is above)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise NemoGymConfigError(f"--nemo-gym-config {config_file}: {first}") from exc
    elif os.environ.get(CONFIG_DICT_ENV):
        config = OmegaConf.create(os.environ[CONFIG_DICT_ENV])
    else:
        raise NemoGymConfigError(
            f"{cls.__name__} is a NeMo Gym server: give its global config with "
            f"--nemo-gym-config FILE, or start it from NeMo Gym's launcher ({CONFIG_DICT_ENV})"
        )
    if not isinstance(config, DictConfig):
        raise NemoGymConfigError("the NeMo Gym config is not a mapping")
    name = name or os.environ.get(CONFIG_PATH_ENV) or _only_instance_of(cls, config)
    _, server = _server_block(config, name)
    host, port, workers = server.get("host"), server.get("port"), server.get("num_workers")
    options = server.get(OPTIONS_KEY)
    return NemoGymInstance(
        name=name,
        host=None if host is None else str(host),
        port=None if port is None else int(port),
        num_workers=None if workers is None else int(workers),
        config=config,
        gym_proxy_options=(
            OmegaConf.to_container(options, resolve=True)
            if isinstance(options, DictConfig | ListConfig)
            else options
        ),
    )


def _server_block(config: Any, instance: str) -> tuple[tuple[str, str], Any]:
    """((server type, server name), the server's config) of `instance`: NeMo Gym nests it
    as `<instance>: {<type>: {<name>: {...}}}`."""
    try:
        by_type = config[instance]
        server_type = next(iter(by_type))
        server_name = next(iter(by_type[server_type]))
        return (str(server_type), str(server_name)), by_type[server_type][server_name]
    except (KeyError, AttributeError, StopIteration, TypeError) as exc:
        detail = f"the NeMo Gym config has no server instance {instance!r}"
        raise NemoGymConfigError(detail) from exc


def _only_instance_of(cls: type, config: Any) -> str:
    """The one instance whose server directory is the class's (`<type>/<name>/app.py`)."""
    from omegaconf import DictConfig

    parts = cls.__module__.split(".")
    found = []
    for name, block in config.items():
        with_type = block.get(parts[0]) if isinstance(block, DictConfig) else None
        if len(parts) >= 2 and isinstance(with_type, DictConfig) and parts[1] in with_type:
            found.append(str(name))
    if len(found) != 1:
        where = f"{parts[0]}.{parts[1]}" if len(parts) >= 2 else cls.__module__
        listed = ", ".join(found) if found else "none"
        raise NemoGymConfigError(
            f"cannot tell which instance of {where} to run (found: {listed}); give --name"
        )
    return found[0]


def build_server_app(cls: type, workers: int) -> Any:
    """The FastAPI app of `cls`, built by its own `run_webserver()` as in a NeMo Gym
    worker process (the proxy put the global config and instance in the environment)."""
    if not os.environ.get(CONFIG_DICT_ENV):
        raise RuntimeError(f"{CONFIG_DICT_ENV} is not set: the proxy resolves it for workers")
    os.environ[WORKER_ENV] = "1"
    os.environ[NUM_WORKERS_ENV] = str(workers)
    server_class: Any = cls  # a SimpleServer subclass (is_server_class said so)
    app = server_class.run_webserver()
    if app is None:
        raise RuntimeError(f"{cls.__name__}.run_webserver() built no app (dry_run is set?)")
    return app


def server_of(app: Any, cls: type) -> Any:
    """The server object behind the app: its routes are the server's bound methods."""
    for route in getattr(app, "routes", ()):
        owner = getattr(getattr(route, "endpoint", None), "__self__", None)
        if isinstance(owner, cls):
            return owner
    raise RuntimeError(f"no route of the app is a method of a {cls.__name__}")


def nemo_gym_participation(cls: type, app: Any, session_state: str | None) -> Participation:
    """How a NeMo Gym server takes part: its kind, and its session dict when declared
    (else it is restart-only, as NeMo Gym's servers are by default)."""
    kind = server_kind(cls) or "resources"
    if session_state is None:
        return Participation(kind=kind, restart_only=True)
    server = server_of(app, cls)
    states = getattr(server, session_state, None)
    if not isinstance(states, MutableMapping):
        found = "no such attribute" if states is None else f"a {type(states).__name__}"
        raise NemoGymConfigError(
            f"--session-state {session_state}: {cls.__name__}.{session_state} is {found}, "
            "not a dict keyed by session ID"
        )
    # Its /run never calls ep.boundary: a running episode ends where it runs.
    return Participation(kind=kind, session_state=states, episode_boundaries=False)


def check_session_state(cls: type, name: str) -> None:
    """NemoGymConfigError unless the server class has an attribute `name` (a field, a
    private attribute or any other), so a mistyped `--session-state` fails before any
    worker starts; whether it holds a dict, only a built server shows (in the worker:
    `nemo_gym_participation`)."""
    fields = getattr(cls, "model_fields", {})
    if name in fields or name in getattr(cls, "__private_attributes__", {}) or hasattr(cls, name):
        return
    dicts = sorted(
        f for f, info in fields.items() if _is_mapping(getattr(info, "annotation", None))
    )
    hint = f" (its dict fields: {', '.join(dicts)})" if dicts else ""
    raise NemoGymConfigError(
        f"--session-state {name}: {cls.__name__} has no attribute {name!r}{hint}"
    )


def _is_mapping(annotation: Any) -> bool:
    origin = typing.get_origin(annotation) or annotation
    return isinstance(origin, type) and issubclass(origin, Mapping)


def launcher_app() -> tuple[str, str] | None:
    """(APP, app dir) for a gym-proxy that NeMo Gym's launcher started in place of a
    server (`entrypoint: -mgym_proxy`, docs/nemo_gym.md): the instance in `NEMO_GYM_CONFIG_PATH` is
    `<type>/<name>`, whose directory (the working directory the launcher gave) holds
    NeMo Gym's `app.py` with the server class. None when not started by the launcher."""
    text, instance = os.environ.get(CONFIG_DICT_ENV), os.environ.get(CONFIG_PATH_ENV)
    if not text or not instance:
        return None
    from omegaconf import OmegaConf

    (server_type, server_name), _ = _server_block(OmegaConf.create(text), instance)
    module_name = f"{server_type}.{server_name}.app"
    cwd = os.getcwd()
    # In the server's directory `<root>/<type>/<name>`: the module lives under <root>.
    root = os.path.dirname(os.path.dirname(cwd)) if os.path.basename(cwd) == server_name else "."
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise NemoGymConfigError(f"{instance}: cannot import {module_name}: {exc}") from exc
    classes = [
        name
        for name, value in vars(module).items()
        if is_server_class(value) and value.__module__ == module_name
    ]
    if len(classes) != 1:
        raise NemoGymConfigError(
            f"{module_name} defines {len(classes)} NeMo Gym server classes ({classes}); "
            "name one as APP"
        )
    return f"{module_name}:{classes[0]}", root

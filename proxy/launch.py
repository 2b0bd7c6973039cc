"""How the workers are launched: the plan settled from the app at start-up
(`WorkerPlan`: what is declared for their environment, the Ray cluster they join), the
launcher chosen for it (`choose_launcher`: a subprocess each, the zygote's forks under
`--preload`, actors on the cluster's nodes under `--worker-placement ray`), and what
they start into once the cluster is up (`launch_of`).

The server (`proxy.server`) makes the launcher before the fleet is built, opens it with
the `Launch` when it has booted the cluster and closes it on its exit stack, after the
workers stopped. Nothing here writes the proxy's own `os.environ`: a worker gets the
proxy's environment plus the plan's, through its launcher.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gym_proxy.coordinator.contract.nemo_gym_env import CONFIG_DICT_ENV
from gym_proxy.coordinator.contract.worker_link import link_key
from gym_proxy.proxy.config import Config
from gym_proxy.proxy.fleet.supervision.launchers import (
    AcceptChannel,
    Launch,
    SubprocessLauncher,
    WorkerLauncher,
)
from gym_proxy.proxy.fleet.supervision.zygote_client import Zygote
from gym_proxy.proxy.ray_cluster.cluster import RayCluster, RayPlan
from gym_proxy.proxy.ray_cluster.lines import PlacementSpec
from gym_proxy.proxy.ray_cluster.mixed import MixedLauncher
from gym_proxy.proxy.ray_cluster.remote_workers import START_WAIT, RayLauncher
from gym_proxy.worker.nemo_gym_server import with_ray_address

__all__ = ["WorkerPlan", "choose_launcher", "launch_of"]


@dataclass(frozen=True)
class WorkerPlan:
    """What the app asks of the workers' start: the environment declared for them (a
    NeMo Gym server's global config and instance name) and the Ray cluster they join
    (None: they use no Ray)."""

    environment: Mapping[str, str] = field(default_factory=dict)
    ray: RayPlan | None = None


def choose_launcher(config: Config, secret: bytes, runtime_dir: str) -> WorkerLauncher:
    """The launcher `config` asks for, made, not yet open (`runtime_dir`: where a Ray
    driver removes what this proxy leaves, should it die)."""
    if config.worker_placement == "ray":
        placed_from = config.local_workers  # the slots before it are local (`MixedLauncher`)
        spec = PlacementSpec(
            workers=max(0, config.workers - placed_from),
            cpus=config.worker_cpus,
            resources=config.ray_resources(),
            strategy=config.worker_strategy.upper(),
            instance=config.instance,
            runtime_dir=runtime_dir,
            keep_for=config.orphan_grace or 0.0,
            most_workers=max(0, (config.max_workers or config.workers) - placed_from),
            preload=_preload(config),
        )
        placed = RayLauncher(
            spec,
            link_key(secret, config.instance),
            config.boot_timeout or START_WAIT,
            placement_wait=config.placement_wait,
        )
        if placed_from:
            local = Zygote.for_config(config) if config.preload else SubprocessLauncher()
            return MixedLauncher(local, placed, placed_from)
        return placed
    if config.preload:
        return Zygote.for_config(config)
    return SubprocessLauncher()


def _preload(config: Config) -> list[str]:
    """What each node's zygote imports with --preload (`proxy.ray_cluster.node_zygote`),
    as the local zygote does (`Zygote.for_config`); none without it."""
    if not config.preload:
        return []
    return [config.app, config.app_dir, str(config.limit_request_line),
            str(config.limit_request_headers)]  # fmt: skip


def launch_of(
    plan: WorkerPlan,
    cluster: RayCluster | None,
    accept_channel: AcceptChannel,
    inherited: Mapping[str, str],
) -> Launch:
    """What the workers start into once `cluster` (the plan's, started or checked) is up:
    the plan's environment, what joining the cluster needs, and a NeMo Gym config (the
    plan's, else the one `inherited` from NeMo Gym's launcher) naming the cluster, as
    NeMo Gym's `initialize_ray()` hands it to the processes it starts."""
    environment = dict(plan.environment)
    if cluster is None:
        return Launch(environment, None, accept_channel)
    environment.update(cluster.environment)
    config_text = environment.get(CONFIG_DICT_ENV) or inherited.get(CONFIG_DICT_ENV)
    if config_text:
        environment[CONFIG_DICT_ENV] = with_ray_address(config_text, cluster.address)
    return Launch(environment, cluster.address, accept_channel)

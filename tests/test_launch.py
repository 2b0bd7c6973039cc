"""Which launcher starts the workers and what they start into (`proxy.launch`,
`proxy.fleet.supervision.launchers`): chosen from the config, refusing to spawn until
the server opens it, and giving a worker the proxy's environment plus the declared one
without writing the proxy's own."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from gym_proxy.coordinator.contract.nemo_gym_env import CONFIG_DICT_ENV, CONFIG_PATH_ENV
from gym_proxy.proxy.config import Config
from gym_proxy.proxy.fleet.supervision.launchers import Launch, SubprocessLauncher
from gym_proxy.proxy.fleet.supervision.zygote_client import Zygote, ZygoteError
from gym_proxy.proxy.launch import WorkerPlan, choose_launcher, launch_of
from gym_proxy.proxy.ray_cluster.cluster import RayCluster, RayPlan
from gym_proxy.proxy.ray_cluster.remote_workers import RayLauncher

pytestmark = pytest.mark.fast

DECLARED = "GYM_PROXY_TEST_DECLARED"


async def _accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


@pytest.mark.parametrize(
    ("options", "kind"),
    [
        ({}, SubprocessLauncher),
        ({"preload": True}, Zygote),
        ({"worker_placement": "ray"}, RayLauncher),
    ],
)
def test_the_config_chooses_the_launcher(options, kind):
    launcher = choose_launcher(Config(workers=2, **options), b"s" * 32, "/run/x")
    assert type(launcher) is kind


async def test_a_launcher_spawns_nothing_before_it_is_open():
    with pytest.raises(OSError, match="the worker launcher is not open"):
        await SubprocessLauncher().spawn([])
    with pytest.raises(ZygoteError, match="the worker launcher is not open"):
        await Zygote.for_config(Config(workers=1, preload=True)).spawn([])


async def test_a_worker_gets_the_declared_environment_and_the_proxy_keeps_its_own():
    """A real process: the declared variable reaches it, beside what the proxy has (PATH);
    the proxy's `os.environ` is not written for it."""
    assert DECLARED not in os.environ
    has = f"os.environ.get({DECLARED!r}) == 'yes' and 'PATH' in os.environ"
    check = f"import os, sys; sys.exit(0 if {has} else 3)"
    launcher = SubprocessLauncher((sys.executable, "-c", check))
    await launcher.open(launch_of(WorkerPlan({DECLARED: "yes"}), None, _accept, os.environ))
    process = await launcher.spawn([])
    assert await asyncio.wait_for(process.wait(), 30) == 0
    assert DECLARED not in os.environ


def test_without_a_cluster_the_launch_is_the_plan():
    plan = WorkerPlan({CONFIG_PATH_ENV: "my_server"})
    launch = launch_of(plan, None, _accept, {CONFIG_DICT_ENV: "a: 1\n"})
    assert launch == Launch({CONFIG_PATH_ENV: "my_server"}, None, _accept)


@pytest.mark.parametrize(
    "declared", [True, False], ids=["the plan's config", "the inherited config"]
)
def test_with_a_cluster_the_workers_config_names_it(declared):
    """The NeMo Gym config the workers get (the plan's, else the one NeMo Gym's launcher
    gave the proxy) names the cluster, as NeMo Gym's `initialize_ray()` hands it on; the
    cluster's own variables join it."""
    pytest.importorskip("omegaconf")
    cluster = RayCluster(RayPlan("10.0.0.1:6379", "RAY_ADDRESS"))
    cluster.address, cluster.auth_mode = "10.0.0.1:6379", "token"
    config_text = "my_server:\n  num_workers: 2\n"
    plan = WorkerPlan({CONFIG_DICT_ENV: config_text} if declared else {})
    inherited = {} if declared else {CONFIG_DICT_ENV: config_text}
    launch = launch_of(plan, cluster, _accept, inherited)
    assert launch.ray_address == "10.0.0.1:6379"
    assert launch.environment["RAY_AUTH_MODE"] == "token"
    assert "ray_head_node_address: 10.0.0.1:6379" in launch.environment[CONFIG_DICT_ENV]
    assert "num_workers: 2" in launch.environment[CONFIG_DICT_ENV]

"""NeMo Gym's heavy servers under gym-proxy, on the real Ray (the NeMo Gym tier): the
released code_gen resources server, whose /verify runs the submitted program's unit tests
as a Ray task, behind `gym-proxy --workers 3`, with one Ray cluster for all its workers
(proxy.ray_cluster.cluster), through a worker's crash, a rolling restart, a resize and a stop;
and the clear failures: nothing answering at a named address, an authentication that
does not fit, a stale Ray session file on the host."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")
pytest.importorskip("ray", reason="the NeMo Gym tier's venv has NeMo Gym's pinned Ray")
psutil = pytest.importorskip("psutil")

from tests.nemo_gym import code_gen  # noqa: E402
from tests.nemo_gym_stack import SharedRay  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.support import (  # noqa: E402
    CONTROL_TOKEN,
    ProxyProcess,
    pid_alive,
    wait_until,
    wait_until_sync,
)

AUTH = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
WORKERS = "/ng-control/v1/gym-proxy/workers"
RAY_EXIT = 5  # gym-proxy's exit status for a Ray cluster it cannot start or join
CLUSTER = re.compile(r"Ray: started a local cluster at (\S+)")


def cluster_address(log: str) -> str:
    """The address of the Ray cluster a gym-proxy's `log` says it started."""
    found = CLUSTER.search(log)
    assert found is not None, log[-3000:]
    return found.group(1)


def write_config(directory: Path, **extra: object) -> Path:
    path = directory / "config.yaml"
    path.write_text(json.dumps(code_gen.config(free_port(), free_port(), **extra)))
    return path


@pytest.fixture
def start(start_proxy: Callable[..., ProxyProcess]) -> Callable[..., ProxyProcess]:
    """code_gen behind gym-proxy (on its test socket), not waiting for ready; stopped
    after the test, with its log shown should the test fail."""

    def start(config: Path, *args: str, workers: int = 3, **kwargs: Any) -> ProxyProcess:
        return start_proxy(
            "--nemo-gym-config", str(config), "--name", code_gen.INSTANCE,
            "--log-level", "info", *args,
            workers=workers, app=code_gen.APP, control_token=CONTROL_TOKEN, ready=False,
            **kwargs,
        )  # fmt: skip

    return start


def ray_processes(root: int) -> dict[str, set[int]]:
    """The Ray cluster processes under `root` (gym-proxy): GCS servers and raylets."""
    found: dict[str, set[int]] = {"gcs_server": set(), "raylet": set()}
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            name = child.name()
        except psutil.NoSuchProcess:
            continue
        if name in found:
            found[name].add(child.pid)
    return found


def one_cluster(proxy: ProxyProcess) -> set[int]:
    """Exactly one GCS server and one raylet under gym-proxy: its pids."""
    found = ray_processes(proxy.pid)
    assert (len(found["gcs_server"]), len(found["raylet"])) == (1, 1), found
    return found["gcs_server"] | found["raylet"]


async def verify_on_every_worker(
    http: aiohttp.ClientSession, proxy: ProxyProcess, rounds: int
) -> None:
    """`rounds` right and wrong programs at once: each scores as it should, and every
    worker served some (least loaded placement spreads concurrent calls)."""

    async def verify(code: str, n: int) -> float:
        body = code_gen.verify_body(code, n)
        async with http.post(f"{proxy.url}/verify", json=body) as response:
            assert response.status == 200, await response.text()
            return (await response.json())["reward"]

    before = await served(http, proxy)
    calls = [(code_gen.RIGHT if i % 2 == 0 else code_gen.WRONG, i + 2) for i in range(2 * rounds)]
    rewards = await asyncio.gather(*(verify(code, n) for code, n in calls))
    assert rewards == [1.0 if code == code_gen.RIGHT else 0.0 for code, _ in calls]
    after = await served(http, proxy)
    assert all(after[slot] > before.get(slot, 0) for slot in after), (before, after)


async def status(http: aiohttp.ClientSession, proxy: ProxyProcess) -> dict:
    async with http.get(f"{proxy.url}/ng-control/v1/checkpoint/status", headers=AUTH) as resp:
        return await resp.json()


async def served(http: aiohttp.ClientSession, proxy: ProxyProcess) -> dict[int, int]:
    return {w["slot"]: w["requests_served"] for w in (await status(http, proxy))["workers"]}


async def operate(http: aiohttp.ClientSession, proxy: ProxyProcess, name: str, **body: Any) -> None:
    async with http.post(f"{proxy.url}{WORKERS}/{name}", json=body, headers=AUTH) as response:
        reply = await response.json()
        assert response.status == 200 and reply["complete"], reply


def stop_and_check_nothing_left(proxy: ProxyProcess, ray_pids: set[int]) -> None:
    """SIGTERM: gym-proxy exits 0, its cluster is gone with it, its runtime dir too."""
    workers = proxy.worker_pids()
    proxy.signal(signal.SIGTERM)
    assert proxy.wait_exit(60) == 0, proxy.log()[-3000:]
    left = {
        p
        for p in ray_pids | set(workers)
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    }
    assert not left, left
    assert proxy.runtime_dirs() == []
    assert "Ray: stopped the local cluster" in proxy.log()


@pytest.mark.timeout(600)  # ten NeMo Gym worker boots on 2 cores
async def test_code_gen_on_three_workers_has_one_cluster_through_crash_restart_and_resize(
    start, tmp_path
):
    """One Ray cluster for 3 workers, rewards right on each; a worker killed with -9, a
    rolling restart and a shrink keep that one cluster, and the replacements join it;
    after SIGTERM nothing of it is left (the next test starts on the same host)."""
    config = write_config(tmp_path)
    proxy = start(config, "--access-log", "--preload")
    proxy.wait_ready(180)
    address = cluster_address(proxy.log())
    assert address != SharedRay.get().address  # a cluster on the host is not attached to
    cluster = one_cluster(proxy)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await verify_on_every_worker(http, proxy, 6)
        victim = (await status(http, proxy))["workers"][0]["pid"]  # (Ray's process is a child too)
        os.kill(victim, signal.SIGKILL)

        async def replaced() -> bool:
            workers = (await status(http, proxy))["workers"]
            return len(workers) == 3 and victim not in {w["pid"] for w in workers}

        await wait_until(replaced, 120, "the killed worker's replacement to register")
        assert one_cluster(proxy) == cluster
        await verify_on_every_worker(http, proxy, 6)
        await operate(http, proxy, "restart", pause_s=0)
        assert one_cluster(proxy) == cluster
        await verify_on_every_worker(http, proxy, 6)
        await operate(http, proxy, "resize", workers=2)
        assert one_cluster(proxy) == cluster
        await verify_on_every_worker(http, proxy, 4)
    stop_and_check_nothing_left(proxy, cluster)


def failed_fast(proxy: ProxyProcess, within: float) -> str:
    """gym-proxy exits RAY_EXIT within `within` seconds; its one ERROR line."""
    started = time.monotonic()
    code = proxy.wait_exit(within + 30)
    elapsed = time.monotonic() - started
    errors = [line for line in proxy.log().splitlines() if " ERROR " in line]
    assert code == RAY_EXIT and len(errors) == 1, (code, proxy.log()[-3000:])
    assert elapsed < within, f"took {elapsed:.1f} s"
    assert proxy.worker_pids() == [] and proxy.runtime_dirs() == []
    return errors[0]


@pytest.mark.parametrize("named_by", ["config", "RAY_ADDRESS"])
def test_nothing_answering_at_the_named_address_is_one_line_within_seconds(
    start, tmp_path, named_by
):
    nowhere = f"127.0.0.1:{free_port()}"
    if named_by == "config":
        proxy = start(write_config(tmp_path, ray_head_node_address=nowhere))
    else:
        proxy = start(write_config(tmp_path), env={"RAY_ADDRESS": nowhere})
    line = failed_fast(proxy, 20)
    assert f"nothing answers at the Ray address {nowhere}" in line
    assert ("ray_head_node_address" if named_by == "config" else "RAY_ADDRESS") in line


def test_an_authentication_that_does_not_fit_is_one_line_within_seconds(start, tmp_path):
    """The shared cluster has token authentication; a user who turned it off is told."""
    config = write_config(tmp_path, ray_head_node_address=SharedRay.get().address)
    proxy = start(config, env={"RAY_AUTH_MODE": "disabled"})
    line = failed_fast(proxy, 30)
    assert "refused this process's authentication (RAY_AUTH_MODE disabled" in line


@pytest.mark.timeout(300)
def test_a_named_token_cluster_is_joined_with_the_token_at_hand(start, tmp_path):
    """No RAY_AUTH_MODE in the environment (as in a shell, unlike under the launcher):
    gym-proxy joins the named token cluster with the token at hand, and so do its
    workers, which Ray alone would not let in."""
    assert "RAY_AUTH_MODE" not in os.environ
    config = write_config(tmp_path, ray_head_node_address=SharedRay.get().address)
    proxy = start(config, workers=2)
    proxy.wait_ready(180)
    assert ray_processes(proxy.pid)["gcs_server"] == set()  # it started none
    assert "(authentication: token)" in proxy.log()


@pytest.mark.timeout(300)
def test_a_stale_session_file_does_not_hang_the_start_and_a_killed_proxy_leaves_no_cluster(
    start, tmp_path
):
    """A dead cluster's session file on the host (what `ray.init()` alone would try to
    join, and hang on): gym-proxy starts its own cluster and serves. Killed with -9, it
    leaves neither its workers (their channel ends) nor its cluster (its Ray process sees
    its pipe close) behind."""
    ray_tmp = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # Ray's socket paths must be short
    Path(ray_tmp, "ray").mkdir()
    Path(ray_tmp, "ray", "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}\n")
    try:
        # No successor is started: without a grace, nothing waits for one.
        proxy = start(
            write_config(tmp_path), "--orphan-grace", "0", workers=1, env={"RAY_TMPDIR": ray_tmp}
        )
        proxy.wait_ready(180)
        left = one_cluster(proxy) | set(proxy.worker_pids())
        os.kill(proxy.pid, signal.SIGKILL)
        proxy.wait_exit(10)
        wait_until_sync(lambda: not any(pid_alive(p) for p in left), 60, "nothing left")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", ["crash", "take-over"])
async def test_the_proxy_that_adopts_the_workers_takes_the_cluster_over_too(start, tmp_path, how):
    """With `--orphan-grace`, gym-proxy alone killed with -9, or an upgrade started beside
    it (`--take-over`): its workers and the Ray cluster it started wait, and the new
    gym-proxy takes both over (the same worker processes, the same cluster's processes),
    every reward right; its stop then leaves nothing of either."""
    config = write_config(tmp_path)
    first = start(config, "--orphan-grace", "60", workers=2)
    first.wait_ready(180)
    cluster, workers = one_cluster(first), first.worker_pids()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await verify_on_every_worker(http, first, 4)
    if how == "crash":
        os.kill(first.pid, signal.SIGKILL)
        first.wait_exit(10)
        second = start(config, "--orphan-grace", "60", workers=2, same_as=first)
    else:
        second = start(
            config, "--orphan-grace", "60", "--take-over", workers=2, same_as=first, inherit=False
        )
        assert first.wait_exit(60) == 0, first.log()[-3000:]
    assert all(pid_alive(p) for p in cluster | set(workers))
    second.wait_ready(180)
    address = cluster_address(first.log())
    assert f"Ray: took over the local cluster at {address}" in second.log()
    previous = "of the dead instance" if how == "crash" else "the previous instance passed on"
    assert f"adopted 2 workers {previous}" in second.log()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await verify_on_every_worker(http, second, 4)
    assert second.worker_pids() == [] and all(pid_alive(p) for p in cluster)
    stop_and_check_nothing_left(second, cluster | set(workers))

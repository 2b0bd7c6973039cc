"""Past one machine, on the engine NeMo Gym already uses: a NeMo Gym deployment grows by
growing its Ray cluster (NeMo-RL runs its Gym actor inside one), and gym-proxy's workers
join it like any NeMo Gym server.

On this machine, a cluster of two Ray nodes (`tests/ray_nodes.py`: `ray start --head`
and `ray start --address`, one CPU each, token authentication on), and NeMo Gym's
released code_gen resources server, unmodified, under `gym-proxy --workers 2`, named the
cluster by `ray_head_node_address` in its config and given the token but not the mode
(it turns token mode on, a token being at hand, as `ray start --head` would). code_gen's
verify runs each program's unit tests as a Ray task (`check_correctness_remote`,
SPREAD): Ray's state API, asked by a driver joined to the cluster, shows them executed on
both nodes, and submitted by both gym-proxy workers (each a Ray driver, a job of its
own). Then the second node is killed (every process of it at once, as a machine is
lost) while verifies run: each still answers, right programs 1.0 and wrong ones 0.0 (Ray
retries the task on the node that is left), or fails with Ray's error named; none hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")
# Found, not imported: the test process never imports Ray (its drivers are processes).
for _module in ("ray", "grpc", "aiohttp_cors", "opencensus"):  # Ray, and its state API's
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"needs {_module} (tests/nemo_gym/install.sh)", allow_module_level=True)

from tests.nemo_gym import code_gen  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.ray_nodes import RayNodes, RayState  # noqa: E402
from tests.support import REPO, TEST_SECRET, wait_until, wait_until_sync  # noqa: E402

# Two Ray nodes and two code_gen workers take a minute to start on a busy 2-core machine.
pytestmark = pytest.mark.timeout(420)

TASK = "check_correctness_remote"  # code_gen's Ray task: one per verify
RAY_ERRORS = ("RayTaskError", "NodeDiedError", "WorkerCrashedError", "RaySystemError",
              "ObjectLostError", "OwnerDiedError", "TaskUnschedulableError")  # fmt: skip


@dataclass
class Deployment:
    nodes: RayNodes
    state: RayState
    url: str
    proxy_log: Path
    timings: dict[str, float] = field(default_factory=dict)

    def node_ids(self) -> tuple[str, str]:
        """(head, second node) IDs, from the state API."""
        nodes = self.state.ask("nodes")
        head = next(n["node_id"] for n in nodes if n["is_head"])
        other = next(n["node_id"] for n in nodes if not n["is_head"])
        return head, other


def start_gym_proxy(directory: Path, nodes: RayNodes, port: int) -> subprocess.Popen[bytes]:
    config = directory / "code_gen.yaml"
    text = json.dumps(code_gen.config(port, free_port(), ray_head_node_address=nodes.address))
    config.write_text(text)  # JSON is YAML
    (directory / "secret").write_text(TEST_SECRET)
    # The token, not the mode, as a shell on a node of the cluster has them.
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env |= {"RAY_AUTH_TOKEN_PATH": str(nodes.token_path), "PYTHONPATH": str(REPO)}
    with open(directory / "proxy.log", "wb") as log:  # the child has its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "gym_proxy", code_gen.APP, "--nemo-gym-config", str(config),
             "--workers", "2", "--secret-file", str(directory / "secret"),
             "--runtime-dir", "/tmp", "--boot-timeout", "300"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip


def stop_gym_proxy(proxy: subprocess.Popen[bytes]) -> None:
    if proxy.poll() is None:
        proxy.send_signal(signal.SIGTERM)  # it stops its workers (Ray drivers) itself
        with contextlib.suppress(subprocess.TimeoutExpired):
            proxy.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proxy.pid, signal.SIGKILL)  # whatever of it is left
    proxy.wait(10)


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    directory = Path(tempfile.mkdtemp(prefix="rmn-", dir="/tmp"))
    nodes = RayNodes(directory)
    proxy: subprocess.Popen[bytes] | None = None
    state: RayState | None = None
    started = time.monotonic()
    timings: dict[str, float] = {}
    try:
        head = nodes.start_head()
        nodes.wait_started(head, 120)
        timings["head"] = time.monotonic() - started
        second = nodes.add_node()  # joins while gym-proxy starts
        port = free_port()
        proxy = start_gym_proxy(directory, nodes, port)
        nodes.wait_started(second, 120)
        state = RayState(nodes)
        wait_until_sync(
            lambda: [n["state"] for n in state.ask("nodes")] == ["ALIVE"] * 2,
            60,
            "both nodes ALIVE in the state API",
        )
        timings["two nodes"] = time.monotonic() - started
        url = f"http://127.0.0.1:{port}"
        wait_until_sync(lambda: _healthy(url, proxy, directory), 300, "gym-proxy to serve")
        timings["gym-proxy ready"] = time.monotonic() - started
        yield Deployment(nodes, state, url, directory / "proxy.log", timings)
    finally:
        if proxy is not None:
            stop_gym_proxy(proxy)
        if state is not None:
            state.close()
        nodes.stop()


def _healthy(url: str, proxy: subprocess.Popen[bytes], directory: Path) -> bool:
    if proxy.poll() is not None:
        log = (directory / "proxy.log").read_text(errors="replace")
        raise AssertionError(f"gym-proxy exited ({proxy.returncode}):\n{log[-4000:]}")
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:  # not listening before every worker registered
        return False


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # Bounds every verify: a hang fails the test, it does not stall it.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=150)) as session:
        yield session


@dataclass
class Outcome:
    right: bool
    status: int
    reward: float | None
    body: str
    done_at: float  # monotonic


async def verify(http: aiohttp.ClientSession, url: str, right: bool, pause: float = 0) -> Outcome:
    """code_gen's /verify of a right or a wrong program (`tests/nemo_gym/code_gen.py`)
    that sleeps `pause` seconds first, so its task runs that long at least."""
    program = (f"import time\ntime.sleep({pause})\n" if pause else "") + (
        code_gen.RIGHT if right else code_gen.WRONG
    )
    async with http.post(f"{url}/verify", json=code_gen.verify_body(program)) as resp:
        body = await resp.text()
        reward = json.loads(body).get("reward") if resp.status == 200 else None
        return Outcome(right, resp.status, reward, body, time.monotonic())


async def tasks(deployment: Deployment) -> list[dict[str, Any]]:
    """Every attempt of every code_gen task so far (`tests/nemo_gym/ray_state.py`)."""
    return await asyncio.to_thread(deployment.state.ask, f"tasks {TASK}")


async def finished(deployment: Deployment, count: int) -> list[dict[str, Any]]:
    """The FINISHED tasks, once there are `count` (the state API hears of a task's end
    within about a second: Ray reports task events periodically)."""

    async def all_in() -> list[dict[str, Any]] | None:
        found = [t for t in await tasks(deployment) if t["state"] == "FINISHED"]
        return found if len(found) == count else None

    return cast(list, await wait_until(all_in, 30, f"{count} {TASK} tasks FINISHED"))


async def settled(deployment: Deployment, before: set[tuple[str, int]], count: int) -> list:
    """The task attempts not in `before`, once `count` tasks have ended (their last
    attempt FINISHED or FAILED)."""

    async def ended() -> list[dict[str, Any]] | None:
        new = [t for t in await tasks(deployment) if (t["task_id"], t["attempt"]) not in before]
        last = {t["task_id"]: t for t in sorted(new, key=lambda t: t["attempt"])}
        done = all(t["state"] in ("FINISHED", "FAILED") for t in last.values())
        return new if done and len(last) == count else None

    return cast(list, await wait_until(ended, 60, f"{count} {TASK} tasks to end"))


async def test_verify_tasks_run_on_both_nodes(deployment: Deployment, http) -> None:
    log = deployment.proxy_log.read_text(errors="replace")
    assert "named by ray_head_node_address" in log and "(authentication: token)" in log, log
    head, other = deployment.node_ids()
    started = time.monotonic()
    sent = 0

    async def a_round() -> Counter[str] | None:
        """6 verifies at once; the tasks per node so far, once both nodes ran some."""
        nonlocal sent
        outcomes = await asyncio.gather(
            *(verify(http, deployment.url, right=i % 2 == 0, pause=1) for i in range(6))
        )
        for outcome in outcomes:
            assert (outcome.status, outcome.reward) == (200, float(outcome.right)), outcome
        sent += len(outcomes)
        by_node = Counter(t["node_id"] for t in await finished(deployment, sent))
        return by_node if by_node[head] and by_node[other] else None

    # SPREAD spreads the tasks over the nodes it can place them on now; on a busy machine
    # the head may run a whole round before the second node has a worker up for
    # code_gen's runtime_env (seconds). Tasks of a second or more, rounds until both ran.
    by_node = cast(Counter, await wait_until(a_round, 150, f"{TASK} tasks on both nodes"))
    jobs = Counter(t["job_id"] for t in await finished(deployment, sent))  # each worker a job
    print(
        f"\nstartup {deployment.timings}; {sent} verifies in {time.monotonic() - started:.1f} s; "
        f"{TASK} tasks per node: head {by_node[head]}, second {by_node[other]}; "
        f"per job (gym-proxy worker): {dict(jobs)}"
    )
    assert by_node[head] and by_node[other], by_node
    assert len(jobs) == 2, jobs  # new sessions go to the least loaded worker: both


async def test_losing_a_node_while_verifies_run(deployment: Deployment, http) -> None:
    head, other = deployment.node_ids()
    second = deployment.nodes.nodes[1]
    before = {(t["task_id"], t["attempt"]) for t in await tasks(deployment)}
    pending: list[asyncio.Task[Outcome]] = []

    def busy_or_done() -> str | None:
        if second.running(TASK):
            return "busy"
        return "done" if all(p.done() for p in pending) else None

    # Slow programs, sent until a Ray worker of the second node is running one.
    for _ in range(3):
        pending += [
            asyncio.create_task(verify(http, deployment.url, right=i % 2 == 0, pause=2))
            for i in range(6)
        ]
        if await wait_until(busy_or_done, 120, f"the second node to run a {TASK}") == "busy":
            break
    else:
        pytest.fail(f"the second node ran no {TASK} in 3 rounds")
    in_flight = sum(not p.done() for p in pending)
    killed_at = time.monotonic()
    await asyncio.to_thread(second.kill)

    def second_dead() -> bool:
        nodes = deployment.state.ask("nodes")
        return any(n["node_id"] == other and n["state"] == "DEAD" for n in nodes)

    async def dead_after() -> float:
        await asyncio.to_thread(wait_until_sync, second_dead, 90, "the second node DEAD")
        return time.monotonic() - killed_at

    outcomes, dead = await asyncio.wait_for(
        asyncio.gather(asyncio.gather(*pending), dead_after()), 150
    )

    answered = [o for o in outcomes if o.status == 200]
    failed = [o for o in outcomes if o.status != 200]
    for outcome in answered:
        assert outcome.reward == float(outcome.right), outcome
    for outcome in failed:  # a clear error: Ray's, named by NeMo Gym's error middleware
        assert outcome.status == 500 and any(e in outcome.body for e in RAY_ERRORS), outcome
    new = await settled(deployment, before, len(outcomes))
    lost = [t for t in new if t["node_id"] == other and t["state"] == "FAILED"]
    assert lost, f"no task failed on the killed node: {new}"
    assert {t["error_type"] for t in lost} <= {"NODE_DIED", "WORKER_DIED"}, lost
    last = {t["task_id"]: t for t in sorted(new, key=lambda t: t["attempt"])}
    ends = [last[task_id] for task_id in {t["task_id"] for t in lost}]
    # Each lost task ran again on the head, or its verify failed with Ray's error.
    for t in ends:
        assert t["state"] == "FAILED" or (t["node_id"] == head and t["attempt"] > 0), t
    assert sum(t["state"] == "FAILED" for t in ends) <= len(failed), (ends, outcomes)

    after = await verify(http, deployment.url, right=True)  # the head alone serves on
    assert (after.status, after.reward) == (200, 1.0), after
    attempts = Counter(
        ("head" if t["node_id"] == head else "second", t["attempt"], t["state"], t["error_type"])
        for t in new
    )
    answers = sorted(round(o.done_at - killed_at, 1) for o in outcomes)
    print(
        f"\nkilled the second node with {in_flight} of {len(outcomes)} verifies in flight: "
        f"{len(answered)} answered, {len(failed)} failed, at {answers} s after the kill; "
        f"the node DEAD in the state API {dead:.1f} s after it; attempts "
        f"(node, attempt, state, error): {dict(attempts)}"
    )

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvloop

from tests.in_process import InProcessProxy, in_process_proxies
from tests.support import ProxyProcess

# Here and in every gym-proxy a test starts: a state change the data path's tables do not
# allow raises (proxy.state_tables).
os.environ["GYM_PROXY_STRICT_STATES"] = "1"

TEST_APP = "tests.apps:create_app"
ASGI_TEST_APP = "tests.asgi_apps:create_app"
BOTH_APP_KINDS = pytest.mark.parametrize(
    "test_app", [TEST_APP, ASGI_TEST_APP], ids=["aiohttp", "asgi"], indirect=True
)


@pytest.fixture
def test_app(request: pytest.FixtureRequest) -> str:
    """The app `start_proxy` runs by default; BOTH_APP_KINDS runs a test over the aiohttp
    app and its ASGI twin (tests/asgi_apps.py)."""
    return getattr(request, "param", TEST_APP)


def pytest_itemcollected(item: pytest.Item) -> None:
    """The NeMo Gym tier is its file name: every test of tests/test_nemo_gym_*.py is
    marked `nemo_gym`, which the second test command selects (a marker written by hand
    could be forgotten, and such a file would run under neither Python)."""
    if item.path.name.startswith("test_nemo_gym_"):
        item.add_marker(pytest.mark.nemo_gym)
        if item.get_closest_marker("timeout") is None:
            # A NeMo Gym stack boots a dozen NeMo Gym processes, beside another test
            # process on 2 cores: the longest took 117 s of the default 120.
            item.add_marker(pytest.mark.timeout(300))


# The longest files, longest first, as measured (`--durations=0`, summed per file, both
# lines of .ci/run, 2026-12-05: 163 s down to 10 s): pytest-xdist hands files out in
# collection order, and a long one started last would run alone at the end. Refresh it
# when a file's time changes by much; a file not named runs after these, as found.
LONGEST_FIRST = (
    "test_nemo_gym_stack.py",
    "test_nemo_gym_ray.py",
    "test_random_operations.py",
    "test_nemo_gym_checkpoint.py",
    "test_reference_stack.py",
    "test_nemo_gym_counter.py",
    "test_nemo_gym_launcher.py",
    "test_nemo_gym_ray_placement.py",
    "test_nemo_gym_ray_autoscaling.py",
    "test_checkpoint_protocol.py",
    "test_live_operations.py",
    "test_rebalance.py",
    "test_episode_handover.py",
    "test_nemo_gym_ray_multinode.py",
    "test_nemo_gym_rebalance.py",
    "test_nemo_gym_servers.py",
    "test_proxy_adoption.py",
    "test_nemo_gym_quickstart.py",
    "test_hung_worker.py",
    "test_lifecycle.py",
    "test_nemo_contract.py",
    "test_session_moves.py",
    "test_checkpoint_restore.py",
    "test_style.py",
    "test_listener_limits.py",
    "test_controller.py",
    "test_metrics.py",
    "test_episodes.py",
    "test_head_fuzz.py",
)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist (3.6+) hands files out by their number of tests, most first, unless
    # told not to: it would ignore LONGEST_FIRST (a 136 s file of 3 tests went late and
    # ran alone at the end, 70 s over the balanced time).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: else as found


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


STARTED_PROXIES = "started_proxies"  # the item's attribute: what start_proxy started


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    """A failed test's proxies stop before any fixture's teardown, the event loop's
    included. A test that failed with a connection still open to a live worker made
    uvloop's `loop.close()` block in `epoll_pwait` for good, where pytest-timeout's
    alarm cannot interrupt it; with the peer gone the loop closes at once. Only after a
    failure: a passing test's fixtures may still talk to its proxy as they tear down."""
    failed = getattr(item, "report_call", None)
    if failed is not None and failed.failed:
        for proxy in getattr(item, STARTED_PROXIES, ()):
            proxy.close_process()
    return (yield)


@pytest.fixture
def start_proxy(
    request: pytest.FixtureRequest, test_app: str
) -> Iterator[Callable[..., ProxyProcess]]:
    """Start real gym-proxy processes; every one is stopped (and its workers reaped) after.
    When the test fails, each proxy's log is printed (pytest shows it with the failure)."""
    started: list[ProxyProcess] = []
    setattr(request.node, STARTED_PROXIES, started)

    def start(
        *args: str,
        workers: int = 2,
        app: str | None = test_app,
        ready: bool = True,
        **kwargs: Any,
    ) -> ProxyProcess:
        if app in (TEST_APP, ASGI_TEST_APP) and "--name" not in args:
            args = (*args, "--name", "apps")  # the twins are one server to checkpoints
        proxy = ProxyProcess(*args, workers=workers, app=app, **kwargs)
        started.append(proxy)
        return proxy.wait_ready() if ready else proxy

    yield start
    for proxy in started:
        proxy.close_process()
    failed = getattr(request.node, "report_call", None)
    if failed is not None and failed.failed:
        for proxy in started:  # all first: proxies started `same_as` share one directory
            print(f"---- gym-proxy log (port {proxy.port}, {proxy.log_path.name}) ----")
            print(proxy.log())
    for proxy in started:
        proxy.cleanup()


@pytest.fixture(scope="module")
def shared_proxy(request: pytest.FixtureRequest) -> Iterator[Callable[..., ProxyProcess]]:
    """`start_proxy` for tests that only read: one gym-proxy per module and command line,
    started on first use and stopped after the module's last test (a start costs 1-2 s;
    a test that changes the server's state, or needs the other app kind, uses
    `start_proxy`). If a test of the module failed, each proxy's log is printed."""
    started: dict[tuple[object, ...], ProxyProcess] = {}
    failed_before = request.session.testsfailed

    def start(*args: str, workers: int = 2, **kwargs: Any) -> ProxyProcess:
        key = (args, workers, tuple(sorted(kwargs.items())))
        if key not in started:
            proxy = ProxyProcess(*args, "--name", "apps", workers=workers, app=TEST_APP, **kwargs)
            started[key] = proxy
            proxy.wait_ready()
        return started[key]

    yield start
    for proxy in started.values():
        proxy.close_process()
    for proxy in started.values():
        if request.session.testsfailed > failed_before:
            print(f"---- gym-proxy log (port {proxy.port}) ----\n{proxy.log()}")
        proxy.cleanup()


@pytest.hookimpl(optionalhook=True)
def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every async test runs on uvloop, the loop gym-proxy and its workers run on: an
    in-process gym-proxy (`in_process`) then runs as it does in production."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
async def in_process() -> AsyncIterator[Callable[..., Awaitable[InProcessProxy]]]:
    """Start gym-proxy in the test's event loop (`tests/in_process.py`), stopped after."""
    async with in_process_proxies() as start:
        yield start


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client that keeps no cookies: tests pass session tokens explicitly."""
    async with aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout(total=30)
    ) as session:
        yield session


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory short enough for a --runtime-dir: Unix socket paths are short, and
    tmp_path is long under pytest-xdist (.../popen-gwN/test_name0)."""
    path = Path(tempfile.mkdtemp(prefix="gpt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)

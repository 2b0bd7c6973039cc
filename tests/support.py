"""Real gym-proxy processes for tests: start, wait for a condition, inspect, stop."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson

from gym_proxy.proxy.config import ConfigError, config_from_args
from gym_proxy.proxy.data_path.session_tokens import TokenCodec

TEST_SECRET = "test-secret-do-not-use"
CONTROL_TOKEN = "test-control-token"
REPO = Path(__file__).resolve().parent.parent


T = TypeVar("T")


def wait_until_sync(predicate: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll `predicate` until it is truthy (answered); fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


async def wait_until(
    predicate: Callable[[], Awaitable[object] | object], within: float, what: str
) -> object:
    """Async form of wait_until_sync; `predicate` may be a coroutine function."""
    deadline = time.monotonic() + within
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.02)


async def app_saw(http: Any, url: str, token: str, path: str) -> bool:
    """Whether the app of the worker holding `token`'s session ran a request to `path`
    (the test apps' `/seen`): past the worker's door, not only forwarded by the proxy,
    whose in-flight count includes a request still in the worker's socket buffer (one
    that a checkpoint then holds at the door, where it is ready)."""
    async with http.get(f"{url}/seen", headers={"X-NeMo-Gym-Session-Token": token}) as resp:
        return path in (await resp.json())["paths"]


def children_of(pid: int) -> list[int]:
    """Direct child pids of `pid` (from /proc)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def worker_processes(proxy_pid: int) -> list[int]:
    """A gym-proxy's workers: its children, but with `--preload` its zygote's children in
    the zygote's place (`worker.zygote`)."""
    pids = []
    for child in children_of(proxy_pid):
        if is_zygote(child):
            pids += children_of(child)
        else:
            pids.append(child)
    return pids


def is_zygote(pid: int) -> bool:
    try:
        return b"gym_proxy.worker.zygote" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class ProxyProcess:
    """One `gym-proxy` process on a pre-bound loopback socket (`--fd`)."""

    def __init__(
        self,
        *args: str,
        workers: int = 2,
        app: str | None = None,
        secret: str | None = TEST_SECRET,
        env: dict[str, str] | None = None,
        control_token: str | None = None,
        cwd: str | Path = REPO,
        nofile: int | None = None,
        new_session: bool = False,
        same_as: ProxyProcess | None = None,
        inherit: bool = True,
    ) -> None:
        """`nofile`: the process's descriptor limit, soft and hard (`ulimit -n`).
        `same_as`: an earlier proxy whose listening socket and runtime parent this one
        takes (the same command started again). `inherit`: the listening socket is
        passed as `--fd` (without: the process gets it otherwise, e.g. `--take-over`)."""
        if same_as is None:
            self.runtime_parent = tempfile.mkdtemp(prefix="gpt-", dir="/tmp")
            self.listener = socket.socket()
            self.listener.bind(("127.0.0.1", 0))
            self.port = self.listener.getsockname()[1]
        else:
            self.runtime_parent, self.listener = same_as.runtime_parent, same_as.listener
            self.port = same_as.port  # its listener may be closed: the proxy holds the socket
        logs = len(list(Path(self.runtime_parent).glob("proxy*.log")))
        self.log_path = Path(self.runtime_parent) / f"proxy{logs or ''}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "gym_proxy",
            "--workers",
            str(workers),
            *(["--fd", str(self.listener.fileno())] if inherit else []),
            "--runtime-dir",
            self.runtime_parent,
        ]
        if app:
            command.insert(3, app)
        if secret is not None:
            command += ["--secret", secret]
        if control_token is not None:
            command += ["--control-token", control_token]
        command += list(args)
        # The session cookie this instance sets (named after the instance, like its tokens;
        # None for a command line gym-proxy refuses).
        try:
            config = config_from_args(command[3:])
        except ConfigError:
            config = None
        self.cookie = config.session_cookie if config is not None else None
        # A token of this instance's form that cannot verify (damaged): always a 400.
        self.bad_token = (
            TokenCodec(secret.encode(), config.instance).prefix + "bogus"
            if config is not None and secret
            else "v2.bogus"
        )
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.popen = subprocess.Popen(
            command,
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=[self.listener.fileno()] if inherit else [],
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            preexec_fn=None if nofile is None else lambda: _limit_descriptors(nofile),
            start_new_session=new_session,  # a process group of its own, as a shell job's
        )
        self.seen_pids: set[int] = set()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> ProxyProcess:
        # Generous: four NeMo Gym workers import for 20 s of CPU, beside another test on a
        # shared 2-core machine (a CI run's 30 s ran out). A stuck start still fails.
        def ready() -> bool:
            if self.popen.poll() is not None:
                raise AssertionError(f"gym-proxy exited early:\n{self.log()}")
            return "ready on http://" in self.log()

        wait_until_sync(ready, timeout, "gym-proxy to be ready")
        self.worker_pids()
        return self

    def worker_pids(self) -> list[int]:
        pids = [p for p in worker_processes(self.pid) if pid_alive(p)]
        self.seen_pids.update(pids)
        return pids

    def runtime_dir(self) -> Path:
        dirs = [p for p in Path(self.runtime_parent).iterdir() if p.is_dir()]
        assert len(dirs) == 1, dirs
        return dirs[0]

    def runtime_dirs(self) -> list[Path]:
        return [p for p in Path(self.runtime_parent).iterdir() if p.is_dir()]

    def kill_all(self) -> None:
        """kill -9 the proxy and every worker at once (a crash of the whole server);
        workers it adopted (`seen_pids`: not its children) too."""
        pids = [self.pid, *self.worker_pids(), *(p for p in self.seen_pids if pid_alive(p))]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.popen.wait(10)
        wait_until_sync(lambda: not any(pid_alive(p) for p in pids), 10, "processes to die")

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def wait_exit(self, timeout: float = 30.0) -> int:
        return self.popen.wait(timeout)

    def close(self) -> None:
        """Stop everything this proxy started, however the test ended."""
        self.close_process()
        self.cleanup()

    def close_process(self) -> None:
        """Stop the proxy and every worker it started (the log stays readable)."""
        self.worker_pids()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        for pid in self.seen_pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)

    def cleanup(self) -> None:
        """Remove the listener, the log and the runtime parent directory."""
        self.listener.close()
        self._log.close()
        shutil.rmtree(self.runtime_parent, ignore_errors=True)


def _limit_descriptors(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


class Control:
    """A minimal checkpoint controller for tests: the HTTP control plane, nothing more."""

    def __init__(self, http: Any, url: str, token: str = CONTROL_TOKEN) -> None:
        self.http = http
        self.base = f"{url}/ng-control/v1/checkpoint"
        self.token = token

    @staticmethod
    def deadline(seconds: float = 30.0) -> float:
        return time.time() + seconds

    async def call(self, op: str, token: str | None = None, **body: Any) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token or self.token}"}
        if op == "status":
            async with self.http.get(f"{self.base}/status", headers=headers) as resp:
                return resp.status, await resp.json()
        body.setdefault("deadline_ts", self.deadline())
        async with self.http.post(f"{self.base}/{op}", json=body, headers=headers) as resp:
            return resp.status, await resp.json()

    async def ok(self, op: str, **body: Any) -> Any:
        status, reply = await self.call(op, **body)
        assert status == 200, (op, status, reply)
        return reply

    async def checkpoint(self, checkpoint_id: str, directory: str, **commit: Any) -> Any:
        """prepare + commit (the caller resumes or kills)."""
        reply = await self.ok("prepare", checkpoint_id=checkpoint_id)
        assert reply["phase"] == "prepared", reply
        return await self.ok(
            "commit", checkpoint_id=checkpoint_id, checkpoint_dir=directory, **commit
        )


def v1_token(secret: bytes, session_id: str, owner: str | None) -> str:
    """A token of the shape gym-proxy's tokens had before they named their instance
    (`v1.<session>.<owner>.<mac>`), signed with `secret`: never this instance's, whatever
    it names and whoever signed it (no release ever minted one)."""
    body = f"v1.{session_id}.{owner or '-'}"
    mac = hmac.new(secret, body.encode(), hashlib.sha256).digest()
    return f"{body}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


def write_checkpoint(base: Path, lines: list[bytes], **manifest: Any) -> None:
    """Write a participant's checkpoint files by hand, as another writer (NeMo Gym, or an
    attacker) would: the records file named by its digest, then the manifest. A manifest
    field given as "<absent>" is left out."""
    base.mkdir(parents=True)
    data = b"".join(line + b"\n" for line in lines)
    digest = hashlib.sha256(data).hexdigest()
    (base / f"records-{digest}.jsonl").write_bytes(data)
    fields = {
        "schema_version": 1,
        "records_file": f"records-{digest}.jsonl",
        "records_sha256": digest,
        "record_count": len(lines),
        **manifest,
    }
    document = {k: v for k, v in fields.items() if v != "<absent>"}
    (base / "manifest.json").write_bytes(orjson.dumps(document))

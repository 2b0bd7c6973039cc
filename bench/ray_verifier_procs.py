"""Every process of one way of serving a server, for bench/ray_verifier.py's CPU, memory
and Ray columns.

A way is started as the leader of a session of its own (`start_new_session`), so its
processes are found three ways and counted once:

- the session: every process whose session ID is the leader's pid (the server, its
  workers, the launcher, and Ray's: `gcs_server`, `raylet`, its Python daemons and its
  workers, which Ray puts in process groups of their own but never in a new session);
- the process tree under the leader (a descendant that made a session of its own);
- Ray's session: every process whose command line names the session directory of a Ray
  cluster the way runs (`<temp dir>/session_<...>`, from its `gcs_server`), so a Ray
  process that left both would still be counted; `outside` says how many did.

CPU is user plus system time of each live process plus that of its children that ended
and were waited for (psutil's `children_user`/`children_system`): a verify's short-lived
processes (code_gen forks a `multiprocessing.Manager` and a test process per verify) are
counted through the Ray worker that waited for them. `raylet` ignores SIGCHLD, so the
kernel reaps a Ray worker that ends and its time is added to no one: a `Meter` samples
the way through the round (bench/ray_verifier.py: every half second) and adds what it
last saw of each such process that ended (at most one interval of its time is missed).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

__all__ = ["CATEGORIES", "Meter", "Snapshot", "Usage", "snapshot"]

CATEGORIES = ("server", "ray tasks", "ray daemons")
# A Ray session directory (`<temp dir>/session_<date>_<time>_<pid>`) in a command line.
SESSION_DIR = re.compile(r"(/\S*/session_\d{4}-\d\d-\d\d_[\d_-]+?)(?=[/\s]|$)")
SIGCHLD_BIT = 1 << (17 - 1)  # SIGCHLD in /proc/<pid>/status masks (Linux)
_DAEMON_MARKS = (
    "ray/autoscaler/",
    "ray/dashboard/",
    "ray/_private/log_monitor",
    "ray::DashboardAgent",
    "ray::RuntimeEnvAgent",
    "gym_proxy.proxy.ray_cluster.head",  # gym-proxy's process that holds its cluster
)


@dataclass(slots=True)
class Proc:
    """One process as seen once."""

    category: str
    cpu: float  # its own CPU seconds and those of its children it waited for
    rss: int
    unwaited: bool  # its parent ignores SIGCHLD (raylet): its time is lost when it ends
    ray_worker: bool  # a worker raylet started (not something a worker forked)


@dataclass
class Snapshot:
    """The processes of a way at one moment."""

    procs: dict[int, Proc] = field(default_factory=dict)
    gcs_servers: int = 0
    outside: int = 0  # Ray processes found only by their session directory

    @property
    def rss(self) -> int:
        return sum(p.rss for p in self.procs.values())

    def rss_by_category(self) -> dict[str, int]:
        by = dict.fromkeys(CATEGORIES, 0)
        for p in self.procs.values():
            by[p.category] += p.rss
        return by


def category(name: str, cmdline: list[str]) -> str:
    """Which part of a way a process is: Ray's daemons, Ray's task workers (and what they
    fork: their command line is theirs), or the server's own processes."""
    line = " ".join(cmdline)
    if name in ("gcs_server", "raylet") or any(mark in line for mark in _DAEMON_MARKS):
        return "ray daemons"
    if line.startswith("ray::"):
        return "ray tasks"
    return "server"


def _ignores_sigchld(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) & SIGCHLD_BIT)
    except OSError:
        pass
    return False


def _members(leader: int, ray_sessions: set[str]) -> tuple[set[int], int]:
    session, extra = set(), set()
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == leader:
                session.add(proc.pid)
            elif ray_sessions and ray_sessions & set(SESSION_DIR.findall(" ".join(proc.cmdline()))):
                extra.add(proc.pid)
        except (psutil.Error, OSError):
            continue
    try:
        tree = {child.pid for child in psutil.Process(leader).children(recursive=True)}
    except psutil.Error:
        tree = set()
    outside = extra - session - tree
    return session | tree | extra | {leader}, len(outside)


def snapshot(leader: int, ray_sessions: set[str]) -> Snapshot:
    """The way led by `leader`; `ray_sessions` collects the session directories of its
    Ray clusters as they are found (pass the same set every time)."""
    pids, outside = _members(leader, ray_sessions)
    snap = Snapshot(outside=outside)
    reapers: dict[int, bool] = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                name, cmdline, ppid = proc.name(), proc.cmdline(), proc.ppid()
                t = proc.cpu_times()
                rss = proc.memory_info().rss
        except psutil.Error:
            continue  # it ended between the listing and now
        if ppid not in reapers:
            reapers[ppid] = _ignores_sigchld(ppid)
        kind = category(name, cmdline)
        snap.procs[pid] = Proc(
            category=kind,
            cpu=t.user + t.system + t.children_user + t.children_system,
            rss=rss,
            unwaited=reapers[ppid],
            ray_worker=kind == "ray tasks" and reapers[ppid],
        )
        if name == "gcs_server":
            snap.gcs_servers += 1
            ray_sessions.update(SESSION_DIR.findall(" ".join(cmdline)))
    return snap


@dataclass
class Usage:
    """What a way used over one round."""

    cpu: dict[str, float]  # CPU seconds by category, "total", and "leader" (of "server")
    peak_rss: int
    peak_rss_by_category: dict[str, int]
    processes: int
    gcs_servers: int
    outside: int
    ray_workers_started: int
    ray_workers_ended: int


class Meter:
    """A way's usage over one round: `begin`, `sample` through the round, `end`."""

    def __init__(self, take: Callable[[], Snapshot], leader: int) -> None:
        self.take = take
        self.leader = leader
        self.first = Snapshot()
        self.seen: dict[int, Proc] = {}
        self.peak = Snapshot()

    def begin(self) -> None:
        self.first = self.sample()

    def sample(self) -> Snapshot:
        snap = self.take()
        self.seen.update(snap.procs)
        if snap.rss > self.peak.rss:
            self.peak = snap
        return snap

    def end(self) -> Usage:
        last = self.sample()
        ended = {pid: p for pid, p in self.seen.items() if pid not in last.procs and p.unwaited}
        cpu = dict.fromkeys(CATEGORIES, 0.0)
        for sign, procs in ((1, last.procs), (-1, self.first.procs), (1, ended)):
            for p in procs.values():
                cpu[p.category] += sign * p.cpu
        cpu["total"] = sum(cpu.values())
        # The leader is the way's front: the server (one), the launcher, or gym-proxy's proxy.
        cpu["leader"] = last.procs[self.leader].cpu - self.first.procs[self.leader].cpu
        return Usage(
            cpu=cpu,
            peak_rss=self.peak.rss,
            peak_rss_by_category=self.peak.rss_by_category(),
            processes=len(last.procs),
            gcs_servers=last.gcs_servers,
            outside=max(last.outside, self.first.outside),
            ray_workers_started=sum(
                1 for pid, p in self.seen.items() if p.ray_worker and pid not in self.first.procs
            ),
            ray_workers_ended=sum(1 for p in ended.values() if p.ray_worker),
        )

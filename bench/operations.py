"""Live operations bench: draining a worker and a rolling restart, both under load.

    python bench/operations.py [--sessions 1000 10000] [--restart-sessions 2000]
        [--workers 4] [--clients 32] [--window 5] [--steady 2] [--light-clients 4]
        [--light-rate 2000] [--json PATH]

1. **Moving a worker's sessions**, per `--sessions` count: gym-proxy (counter app, 2
   workers, control token), that many sessions seeded (about half on each worker), a
   light paced pooled load (`--light-clients` on one aiohttp ClientSession,
   `--light-rate` requests/s in all, each to a random session: under a fifth of what the
   proxy serves closed-loop here, yet enough that a move of tens of ms sees some
   requests of the sessions it moves), then `workers/drain` of slot 0. Times the call
   and the answer's `seconds`, counts failed requests, and compares the latency of the
   moved sessions' requests that overlapped the call with the same load's steady state
   before it; then checks a sample of counters exactly.
2. **Rolling restart**: gym-proxy with `--workers`, `--restart-sessions` sessions, a
   closed-loop pooled load (`--clients` on one ClientSession, each to a random session),
   a steady window of `--window` s, `workers/restart` of every slot while the load runs,
   a steady window after; requests/s and latency per window, the restart's seconds per
   slot (from polling status every 10 ms), and every counter checked exactly at the end.

The bench's client shares the machine's cores with the proxy and its workers (run on
uvloop to keep its share down); compare windows within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint import CONTROL, TOKEN_HEADER, kill_tree, start, wait_up  # noqa: E402
from routing import data_path_mode  # noqa: E402
from servers import TICK, children, cpu_seconds  # noqa: E402

WORKERS = "/ng-control/v1/gym-proxy/workers"
STATUS = "/ng-control/v1/checkpoint/status"
AUTH = {"Authorization": f"Bearer {CONTROL}"}
BODY = b'{"count": 1}'
# A hard stop for every load loop, whatever happens to the control calls.
LOAD_LIMIT_S = 150.0
DRAIN_TARGET = (10_000, 1.0)  # sessions off one worker, in seconds
THROUGHPUT_TARGET = 0.8
P99_ADDED_TARGET_MS = 50.0


def machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of every core, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def server_cpu(pid: int) -> float:
    """CPU seconds of the proxy and of every worker it started, live or gone (a stopped
    worker's CPU joins the proxy's cutime and cstime when it is reaped)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = sum(int(f) for f in fields[11:15]) / TICK
    for child in children(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(child)
    return total


@dataclass
class Mark:
    """A window boundary: the clock and the CPU counters at that moment."""

    t: float
    proxy_cpu: float
    server_cpu: float
    bench_cpu: float
    machine: tuple[int, int]

    @classmethod
    def now(cls, proxy_pid: int) -> Mark:
        return cls(
            time.perf_counter(),
            cpu_seconds(proxy_pid),
            server_cpu(proxy_pid),
            time.process_time(),
            machine_cpu(),
        )


@dataclass
class Load:
    """Clients on one shared ClientSession, each request an increment of a random session;
    every request is recorded, and what each session was sent is counted so counters can
    be checked exactly. Every loop stops by itself (`most`, LOAD_LIMIT_S)."""

    http: aiohttp.ClientSession
    url: str
    tokens: list[str]
    sent: list[int] = field(init=False)
    # A session whose request failed may or may not have counted it.
    uncertain: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    started: list[float] = field(default_factory=list)
    ended: list[float] = field(default_factory=list)
    session: list[int] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)
    stopping: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sent = [0] * len(self.tokens)

    def start(self, clients: int, rate: float | None, most: int) -> None:
        interval = clients / rate if rate else 0.0
        deadline = time.perf_counter() + LOAD_LIMIT_S
        self.tasks = [
            asyncio.ensure_future(self._client(random.Random(c), interval, most, deadline))
            for c in range(clients)
        ]

    async def _client(
        self, rng: random.Random, interval: float, most: int, deadline: float
    ) -> None:
        clock = time.perf_counter
        url = f"{self.url}/increment_counter"
        next_at = clock()
        for _ in range(most):
            if self.stopping or clock() > deadline:
                return
            if interval:
                next_at += interval
                delay = next_at - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    next_at = clock()  # behind schedule: no burst to catch up
            i = rng.randrange(len(self.tokens))
            headers = {TOKEN_HEADER: self.tokens[i], "Content-Type": "application/json"}
            began = clock()
            ok = False
            try:
                async with self.http.post(url, data=BODY, headers=headers) as resp:
                    text = await resp.read()
                    ok = resp.status == 200
                    if not ok:
                        self.errors.append(f"{resp.status} {text[:200]!r}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.errors.append(repr(exc))
            self.started.append(began)
            self.ended.append(clock())
            self.session.append(i)
            self.ok.append(ok)
            if ok:
                self.sent[i] += 1
            else:
                self.uncertain.add(i)

    async def stop(self) -> None:
        self.stopping = True
        await asyncio.wait_for(asyncio.gather(*self.tasks), 60)

    def window(
        self, lo: float, hi: float, *, overlap: bool = False, sessions: set[int] | None = None
    ) -> dict[str, Any]:
        """Requests that ended in [lo, hi) (or, with `overlap`, ran at any time in it):
        latency percentiles, failures; req/s counts every completion in the window."""
        latencies: list[float] = []
        failed = completed = 0
        for began, ended, i, ok in zip(
            self.started, self.ended, self.session, self.ok, strict=True
        ):
            if lo <= ended < hi:
                completed += 1
            if sessions is not None and i not in sessions:
                continue
            if not (began < hi and ended > lo if overlap else lo <= ended < hi):
                continue
            latencies.append(ended - began)
            failed += not ok
        latencies.sort()
        n = len(latencies)

        def pick(q: float) -> float | None:
            return latencies[min(n - 1, int(q * n))] * 1000 if n else None

        return {
            "seconds": hi - lo,
            "requests": n,
            "completed": completed,
            "rps": completed / (hi - lo) if hi > lo else 0.0,
            "failed": failed,
            "p50_ms": pick(0.50),
            "p99_ms": pick(0.99),
            "p999_ms": pick(0.999),
            "max_ms": latencies[-1] * 1000 if n else None,
        }


def cpu_between(a: Mark, b: Mark, requests: int) -> dict[str, float | None]:
    busy, total = b.machine[0] - a.machine[0], b.machine[1] - a.machine[1]
    server, bench = b.server_cpu - a.server_cpu, b.bench_cpu - a.bench_cpu
    # Percentages of every core (100: all busy). The machine is shared: "other" is what
    # neither this server nor this bench used, so a noisy window shows as such.
    cores_s = (b.t - a.t) * (os.cpu_count() or 1)
    # /proc/stat counts in jiffies (10 ms): a shorter window than a few dozen says nothing.
    machine = 100.0 * busy / total if total >= 50 else None
    return {
        "proxy_cpu_us": (b.proxy_cpu - a.proxy_cpu) * 1e6 / requests if requests else None,
        "server_cpu_us": server * 1e6 / requests if requests else None,
        "bench_cpu_us": bench * 1e6 / requests if requests else None,
        "machine_busy_pct": machine,
        "other_pct": None if machine is None else machine - 100.0 * (server + bench) / cores_s,
    }


async def seed(http: aiohttp.ClientSession, url: str, sessions: int) -> list[str]:
    tokens = [""] * sessions

    async def one(i: int) -> None:
        async with http.post(f"{url}/seed_session", json={"initial_count": i}) as resp:
            if resp.status != 200:
                raise SystemExit(f"seed failed: {resp.status} {await resp.text()}")
            tokens[i] = resp.headers[TOKEN_HEADER]

    await asyncio.gather(*(one(i) for i in range(sessions)))
    return tokens


async def check_counters(load: Load, indexes: list[int]) -> dict[str, Any]:
    """Each listed session's counter against its seed (its index) plus what was sent."""
    wrong: list[dict[str, int]] = []
    todo = [i for i in indexes if i not in load.uncertain]

    async def one(i: int) -> None:
        headers = {TOKEN_HEADER: load.tokens[i]}
        async with load.http.post(f"{load.url}/get_counter_value", headers=headers) as resp:
            count = (await resp.json())["count"] if resp.status == 200 else -1
        if count != i + load.sent[i]:
            wrong.append({"session": i, "expected": i + load.sent[i], "got": count})

    await asyncio.gather(*(one(i) for i in todo))
    return {"checked": len(todo), "skipped_uncertain": len(indexes) - len(todo), "wrong": wrong}


async def operate(
    control: aiohttp.ClientSession, url: str, name: str, **body: object
) -> tuple[int, dict[str, Any], float]:
    started = time.perf_counter()
    async with control.post(f"{url}{WORKERS}/{name}", json=body, headers=AUTH) as resp:
        reply = await resp.json()
    return resp.status, reply, time.perf_counter() - started


async def status(control: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with control.get(f"{url}{STATUS}", headers=AUTH) as resp:
        return await resp.json()


def sessions_http(clients: int) -> aiohttp.ClientSession:
    # No cookie jar: one shared session must not carry one session's cookie to all.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max(64, clients + 8)),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=60),
    )


def stop_proxy(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        kill_tree(proc)


def log_tail(runtime: str, lines: int = 30) -> list[str]:
    text = "".join(p.read_text(errors="replace") for p in Path(runtime).glob("proxy-*.log"))
    return text.splitlines()[-lines:]


# ---- 1. draining one worker ---------------------------------------------------------
async def drain_run(
    control: aiohttp.ClientSession, sessions: int, opts: argparse.Namespace
) -> dict[str, Any]:
    runtime = tempfile.mkdtemp(prefix="gpo-", dir="/tmp")
    proc, url = start(2, runtime)
    problems: list[str] = []
    try:
        await wait_up(control, url)
        owners = {w["owner"]: w["slot"] for w in (await status(control, url))["workers"]}
        async with sessions_http(opts.light_clients) as http:
            tokens = await seed(http, url, sessions)
            # A token is v2.<instance tag>.<session>.<owner>.<mac>.
            on_zero = {i for i, t in enumerate(tokens) if owners[t.split(".")[3]] == 0}
            load = Load(http, url, tokens)
            load.start(opts.light_clients, opts.light_rate, most=int(LOAD_LIMIT_S * 1000))
            await asyncio.sleep(0.5)  # connections up
            steady_from = Mark.now(proc.pid)
            await asyncio.sleep(opts.steady)
            steady_to = Mark.now(proc.pid)
            code, reply, call_s = await operate(control, url, "drain", slot=0, timeout_s=60)
            drained = Mark.now(proc.pid)
            call_to = drained.t
            call_from = call_to - call_s
            await asyncio.sleep(1.0)  # the moved sessions keep serving on worker 1
            await load.stop()
            moved_ok = (
                code == 200
                and reply.get("complete")
                and not reply.get("failed")
                and reply.get("moved") == len(on_zero)
            )
            if not moved_ok:
                problems.append(f"drain answered {code}: {json.dumps(reply)[:600]}")
            rng = random.Random(sessions)
            others = sorted(set(range(sessions)) - on_zero)
            sample = rng.sample(sorted(on_zero), min(opts.check, len(on_zero)))
            sample += rng.sample(others, min(opts.check, len(others)))
            counters = await check_counters(load, sample)
            after = await status(control, url)
        steady = load.window(steady_from.t, steady_to.t)
        steady.update(cpu_between(steady_from, steady_to, steady["completed"]))
        # steady_to was taken just before the call
        drain_cpu = cpu_between(steady_to, drained, 0)
        during = load.window(call_from, call_to, overlap=True, sessions=on_zero)
        total = load.window(0.0, float("inf"))
        if load.errors:
            problems.append(f"{len(load.errors)} failed requests, first: {load.errors[:3]}")
        if counters["wrong"]:
            problems.append(f"wrong counters: {counters['wrong'][:5]}")
        return {
            "sessions": sessions,
            "on_worker_0": len(on_zero),
            "code": code,
            "reply": {k: v for k, v in reply.items() if k != "failed"}
            | {"failed": reply.get("failed", [])[:20]},
            "call_s": call_s,
            "answer_s": reply.get("seconds"),
            "moved": reply.get("moved"),
            "complete": reply.get("complete"),
            "steady": steady,
            "moved_sessions_during": during,
            "drain_cpu": drain_cpu,
            "all_requests": total["requests"],
            "failed_requests": len(load.errors),
            "errors": load.errors[:20],
            "counters": counters,
            "workers_after": after["workers"],
            "problems": problems,
            "runtime": runtime,
            "log_tail": log_tail(runtime) if problems else [],
        }
    finally:
        stop_proxy(proc)


# ---- 2. rolling restart -------------------------------------------------------------
# A status call costs the proxy about 120 us of CPU: about 1% of a core at this rate.
POLL_S = 0.01


async def poll_progress(
    control: aiohttp.ClientSession,
    url: str,
    seen: list[tuple[float, str, int]],
    boot_cpu: dict[int, float],
    done: list[bool],
) -> None:
    """(time, step, sessions moved) of the running operation, every POLL_S; and each
    replacement's CPU seconds when it has registered (its boot's cost, which a machine
    with no idle core takes from serving)."""
    for _ in range(int(LOAD_LIMIT_S / POLL_S)):
        if done:
            return
        try:
            running = (await status(control, url))["operations"]["running"]
        except (aiohttp.ClientError, TimeoutError, KeyError):
            running = None
        if running is not None:
            seen.append((time.perf_counter(), running["step"], running["moved"]))
            for entry in running["slots"]:
                if "new_pid" in entry and entry["slot"] not in boot_cpu:
                    with contextlib.suppress(OSError):
                        boot_cpu[entry["slot"]] = cpu_seconds(entry["new_pid"])
        await asyncio.sleep(POLL_S)


def per_slot(
    load: Load,
    seen: list[tuple[float, str, int]],
    slots: list[int],
    call_from: float,
    call_to: float,
) -> list[dict[str, Any]]:
    """Each slot's boot (starting -> moving) and move-and-stop (moving -> the next slot's
    start or the answer) from the polled steps, with the load's req/s and p99 in each, to
    tell the cost of booting a worker from that of moving its sessions; None where a step
    fell between polls."""

    def first(prefix: str) -> float | None:
        return next((t for t, step, _ in seen if step.startswith(prefix)), None)

    rows = []
    for k, slot in enumerate(slots):
        begin = first(f"slot {slot}: starting") or (call_from if k == 0 else None)
        moving = first(f"slot {slot}: moving")
        end = call_to
        if k + 1 < len(slots):  # the pause before the next slot (pause_s) is neither
            later = slots[k + 1]
            end = next(
                (t for t, step, _ in seen if step.endswith(f"before slot {later}")),
                first(f"slot {later}: starting") or call_to,
            )
        row: dict[str, Any] = {"slot": slot, "boot": None, "move_stop": None}
        if begin is not None and moving is not None:
            row["boot"] = load.window(begin, moving, overlap=True)
        if moving is not None:
            row["move_stop"] = load.window(moving, end, overlap=True)
        row["total_s"] = end - begin if begin is not None else None
        rows.append(row)
    return rows


async def restart_run(control: aiohttp.ClientSession, opts: argparse.Namespace) -> dict[str, Any]:
    runtime = tempfile.mkdtemp(prefix="gpo-", dir="/tmp")
    proc, url = start(opts.workers, runtime)
    problems: list[str] = []
    try:
        await wait_up(control, url)
        before_workers = (await status(control, url))["workers"]
        async with sessions_http(opts.clients) as http:
            tokens = await seed(http, url, opts.restart_sessions)
            load = Load(http, url, tokens)
            load.start(opts.clients, None, most=200_000)
            await asyncio.sleep(1.0)  # connections up, caches warm
            m0 = Mark.now(proc.pid)
            await asyncio.sleep(opts.window)
            m1 = Mark.now(proc.pid)
            seen: list[tuple[float, str, int]] = []
            boot_cpu: dict[int, float] = {}
            done: list[bool] = []
            poller = asyncio.ensure_future(poll_progress(control, url, seen, boot_cpu, done))
            pause = {} if opts.restart_pause is None else {"pause_s": opts.restart_pause}
            code, reply, call_s = await operate(control, url, "restart", timeout_s=60, **pause)
            m2 = Mark.now(proc.pid)
            done.append(True)
            await poller
            call_from = m2.t - call_s
            await asyncio.sleep(opts.window)
            m3 = Mark.now(proc.pid)
            await load.stop()
            counters = await check_counters(load, list(range(len(tokens))))
            after_workers = (await status(control, url))["workers"]
        windows = {
            "before": load.window(m0.t, m1.t),
            "during": load.window(call_from, m2.t, overlap=True),
            "after": load.window(m2.t, m3.t),
        }
        # The restart window's req/s counts what completed inside the call.
        windows["during"]["rps"] = windows["during"]["completed"] / call_s
        for name, (a, b) in {"before": (m0, m1), "during": (m1, m2), "after": (m2, m3)}.items():
            # CPU marks of "during" start at m1: the poller's first look is within ms
            windows[name].update(cpu_between(a, b, windows[name]["completed"]))
        slots = [s["slot"] for s in reply.get("slots", [])]
        old_pids = {w["pid"] for w in before_workers}
        new_pids = {w["pid"] for w in after_workers}
        if code != 200 or not reply.get("complete") or reply.get("failed"):
            problems.append(f"restart answered {code}: {json.dumps(reply)[:800]}")
        if len(after_workers) != opts.workers or old_pids & new_pids:
            problems.append(f"workers after the restart: {after_workers}")
        if load.errors:
            problems.append(f"{len(load.errors)} failed requests, first: {load.errors[:3]}")
        if counters["wrong"]:
            problems.append(f"wrong counters: {counters['wrong'][:5]}")
        return {
            "workers": opts.workers,
            "sessions": opts.restart_sessions,
            "clients": opts.clients,
            "code": code,
            "reply": reply,
            "call_s": call_s,
            "answer_s": reply.get("seconds"),
            "windows": windows,
            "per_slot": per_slot(load, seen, slots, call_from, m2.t),
            "boot_cpu_s": boot_cpu,
            "polled_steps": [(round(t - call_from, 3), s, m) for t, s, m in seen],
            "failed_requests": len(load.errors),
            "errors": load.errors[:20],
            "counters": counters,
            "workers_before": before_workers,
            "workers_after": after_workers,
            "problems": problems,
            "runtime": runtime,
            "log_tail": log_tail(runtime) if problems else [],
        }
    finally:
        stop_proxy(proc)


# ---- printing -----------------------------------------------------------------------
def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def print_drain(rows: list[dict[str, Any]], opts: argparse.Namespace) -> None:
    sessions, seconds = DRAIN_TARGET
    print(
        f"1. Moving a worker's sessions: 2 workers, workers/drain of slot 0 under a light "
        f"pooled load ({opts.light_clients} clients, {opts.light_rate:g} req/s in all); "
        f"target {sessions:,} sessions off one worker in <= {seconds:g} s"
    )
    print()
    columns = [
        "sessions",
        "moved (of worker 0's)",
        "drain call s",
        "answer s",
        f"s per {sessions:,} moved (target <= {seconds:g})",
        "failed requests",
        "steady p50 / p99 ms (n)",
        "moved sessions in the move: p50 / p99 / max ms (n)",
        "added p99 ms",
        "proxy CPU us/req (steady)",
        "other processes % (steady / drain)",
        "counters checked / wrong",
    ]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        s, d = r["steady"], r["moved_sessions_during"]
        per = r["call_s"] * sessions / r["on_worker_0"] if r["on_worker_0"] else None
        added = d["p99_ms"] - s["p99_ms"] if d["p99_ms"] is not None and s["p99_ms"] else None
        verdict = "" if per is None else (" ok" if per <= seconds else " MISSED")
        print(
            f"| {r['sessions']:,} | {r['moved']:,} ({r['on_worker_0']:,}) | {r['call_s']:.3f} "
            f"| {r['answer_s']:.3f} | {per:.3f}{verdict} | {r['failed_requests']} "
            f"| {ms(s['p50_ms'])} / {ms(s['p99_ms'])} ({s['requests']}) "
            f"| {ms(d['p50_ms'])} / {ms(d['p99_ms'])} / {ms(d['max_ms'])} ({d['requests']}) "
            f"| {ms(added)} | {us(s['proxy_cpu_us'])} "
            f"| {ms(s['other_pct'])} / {ms(r['drain_cpu']['other_pct'])} "
            f"| {r['counters']['checked']} / {len(r['counters']['wrong'])} |"
        )
    print()


def print_restart(r: dict[str, Any]) -> None:
    w = r["windows"]
    print(
        f"2. Rolling restart: {r['workers']} workers, {r['sessions']:,} sessions, "
        f"{r['clients']} closed-loop pooled clients; workers/restart of every slot"
    )
    print()
    columns = ["window", "s", "requests", "req/s", "p50 ms", "p99 ms", "p99.9 ms", "max ms"]
    columns += ["failed", "proxy CPU us/req", "server CPU us/req", "bench CPU us/req"]
    columns += ["machine busy %", "other processes %"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for name in ("before", "during", "after"):
        x = w[name]
        print(
            f"| {name} | {x['seconds']:.2f} | {x['requests']:,} | {x['rps']:,.0f} "
            f"| {ms(x['p50_ms'])} | {ms(x['p99_ms'])} | {ms(x['p999_ms'])} | {ms(x['max_ms'])} "
            f"| {x['failed']} | {us(x['proxy_cpu_us'])} | {us(x['server_cpu_us'])} "
            f"| {us(x['bench_cpu_us'])} | {ms(x['machine_busy_pct'])} | {ms(x['other_pct'])} |"
        )
    print()
    ratio = w["during"]["rps"] / w["before"]["rps"] if w["before"]["rps"] else 0.0
    added = (w["during"]["p99_ms"] or 0.0) - (w["before"]["p99_ms"] or 0.0)
    ok = {True: "ok", False: "MISSED"}
    print(
        f"- throughput during / before: {ratio:.2f}x "
        f"(target >= {THROUGHPUT_TARGET}x: {ok[ratio >= THROUGHPUT_TARGET]})"
    )
    print(
        f"- p99 during - before: {added:+.1f} ms "
        f"(target <= {P99_ADDED_TARGET_MS:g} ms: {ok[added <= P99_ADDED_TARGET_MS]})"
    )
    print(f"- failed requests: {r['failed_requests']} (target 0: {ok[r['failed_requests'] == 0]})")
    reply = r["reply"]
    print(
        f"- restart: call {r['call_s']:.3f} s, answer {r['answer_s']:.3f} s, "
        f"complete {reply.get('complete')}, {reply.get('moved')} sessions moved, "
        f"{len(reply.get('failed', []))} not"
    )
    c = r["counters"]
    print(f"- counters: {c['checked']:,} checked, {len(c['wrong'])} wrong")
    print()
    columns = ["slot", "boot s", "req/s", "p99 ms", "move + stop s", "req/s", "p99 ms"]
    columns += ["slot total s", "replacement's boot CPU s", "outcome"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    outcomes = {s["slot"]: s.get("outcome", "-") for s in reply.get("slots", [])}
    for s in r["per_slot"]:
        cells = [str(s["slot"])]
        for phase in ("boot", "move_stop"):
            x = s[phase]
            cells += (
                ["-"] * 3
                if x is None
                else [f"{x['seconds']:.3f}", f"{x['rps']:,.0f}", ms(x["p99_ms"])]
            )
        boot_cpu = r["boot_cpu_s"].get(s["slot"])
        cells += [ms3(s["total_s"]), ms3(boot_cpu), outcomes.get(s["slot"], "-")]
        print("| " + " | ".join(cells) + " |")
    print(
        "(per slot: phases from the running operation's step, polled every 10 ms; "
        "req/s counts completions in the phase, p99 the requests that overlap it)"
    )
    print()


def ms3(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


async def main(opts: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join(["python", "bench/operations.py", *sys.argv[1:]]),
        "cores": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "data_path": data_path_mode(),
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as control:
        if opts.sessions:
            result["drain"] = [await drain_run(control, n, opts) for n in opts.sessions]
        if opts.restart_sessions:
            result["restart"] = await restart_run(control, opts)
    print(f"gym-proxy live operations bench, {result['date']}, {result['cores']} cores, "
          f"data path {result['data_path']}")  # fmt: skip
    print()
    if "drain" in result:
        print_drain(result["drain"], opts)
    if "restart" in result:
        print_restart(result["restart"])
    runs = [*result.get("drain", []), *([result["restart"]] if "restart" in result else [])]
    for run in runs:
        for problem in run["problems"]:
            print(f"PROBLEM ({run['runtime']}): {problem}")
        for line in run["log_tail"]:
            print(f"  proxy log: {line}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="*", default=[1000, 10_000])
    parser.add_argument("--restart-sessions", type=int, default=2000)
    parser.add_argument(
        "--restart-pause", type=float, default=None, help="pause_s (default: the server's)"
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument("--steady", type=float, default=2.0)
    parser.add_argument("--light-clients", type=int, default=4)
    parser.add_argument("--light-rate", type=float, default=2000.0)
    parser.add_argument("--check", type=int, default=500, help="counters per worker, table 1")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    outcome = uvloop.run(main(options))
    if options.json:
        options.json.write_text(json.dumps(outcome, indent=1) + "\n")

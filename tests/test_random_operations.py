"""Seeded random operations against real gym-proxy processes, checked against a model.

Each seed starts a participant with 1-3 workers and drives a random walk of: new
sessions (a seed during a checkpoint waits at the door: this is a resources server),
held requests (blockers), parked episodes, prepare, commit (sometimes scoped, sometimes
with `stop`), resume, retire (in idle and in restored), forget, a late request of a
retired attempt, kill -9 of a worker (its replacement held back), the late join of that
replacement, a crash of everything followed by a restore onto 1-3 fresh workers (of all
the committed episodes or some), and replacement `/run`s that claim restored episodes as
attempt N+1 (or name a wrong attempt). After every step:

- the phase is the model's, and admission is open on every live worker whenever idle;
- the blockers (and their count) equal a fresh recount from the model;
- the restored episodes awaiting a claim and the count of retired rollouts are the
  model's;
- every commit exports exactly the model's running and unclaimed restored episodes within
  its scope, none of an attempt retired before it, and releases unclaimed ones outside it;
- every manifest written so far verifies; after a restore, every session that was
  committed has its committed value.

`GYM_PROXY_RANDOM_SEEDS` sets the number of seeds (default 100),
`GYM_PROXY_RANDOM_FIRST_SEED` the first one (to replay a failing seed alone).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from coordinator import checkpoint_files as records
from coordinator.contract import records as record_format
from coordinator.contract.episodes import EpisodeId, parse_episode_key
from tests.support import CONTROL_TOKEN, Control, ProxyProcess, wait_until

SEEDS = int(os.environ.get("GYM_PROXY_RANDOM_SEEDS", "100"))
FIRST_SEED = int(os.environ.get("GYM_PROXY_RANDOM_FIRST_SEED", "0"))
STEPS = 16
PARALLEL = 3
TOKEN = "X-NeMo-Gym-Session-Token"
OWNER = "x-ng-session-owner"


@dataclass
class Model:
    phase: str = "idle"
    sessions: dict[str, tuple[str, int]] = field(default_factory=dict)  # sid -> (token, count)
    held: dict[str, asyncio.Task] = field(default_factory=dict)  # sid -> request task
    held_owner: dict[str, str] = field(default_factory=dict)
    episodes: dict[str, str] = field(default_factory=dict)  # running: capture key -> owner
    pending: set[str] = field(default_factory=set)  # restored, awaiting a claim: N+1 keys
    tasks_of: dict[str, str] = field(default_factory=dict)  # rollout -> its task's gate
    marks: dict[str, int] = field(default_factory=dict)  # rollout -> highest retired attempt
    door_seeds: list[tuple[asyncio.Task, int]] = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)
    lost: bool = False
    held_back: int = 0  # killed workers whose replacement is not allowed to register
    committed: list[tuple[Path, dict[str, tuple[str, int]], set[str]]] = field(default_factory=list)
    serial: int = 0

    def blockers(self, expected: int, live: int) -> list[str]:
        head = [f"resources-workers-unreported:{expected - live}"] if live < expected else []
        if self.lost:
            head.append("resources-worker-lost")
        return head + sorted(f"session:{sid}" for sid in self.held)

    def retired(self, key: str) -> bool:
        ident = parse_episode_key(key)
        return ident.attempt <= self.marks.get(ident.rollout_id, -1)


class Walk:
    def __init__(self, seed: int, http: aiohttp.ClientSession, root: Path) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.http = http
        self.root = root
        self.hold = root / "hold"
        self.model = Model()
        self.proxy: ProxyProcess | None = None
        self.expected = 0
        self.trail: list[str] = []  # operations so far, for the failure message
        self.last_log = ""

    # ---- plumbing ---------------------------------------------------------------
    def start(self, workers: int) -> None:
        self.expected = workers
        self.proxy = ProxyProcess(
            workers=workers,
            app="tests.apps:create_app",
            control_token=CONTROL_TOKEN,
            env={"GYM_TEST_HOLD_FILE": str(self.hold)},
        )
        self.proxy.wait_ready()
        self.control = Control(self.http, self.proxy.url)

    async def status(self) -> dict:
        return await self.control.ok("status")

    async def live(self) -> list[dict]:
        return (await self.status())["workers"]

    def cid(self) -> str:
        self.model.serial += 1
        return f"s{self.seed}-c{self.model.serial}"

    async def post(self, path: str, **kwargs) -> tuple[int, dict, dict]:
        async with self.http.post(f"{self.proxy.url}{path}", **kwargs) as resp:
            return resp.status, resp.headers.copy(), await resp.json()

    async def seen(self, owner: str, path: str) -> bool:
        async with self.http.get(f"{self.proxy.url}/seen", headers={OWNER: owner}) as resp:
            body = await resp.json()
            assert resp.status == 200, (owner, body)
            return path in body["paths"]

    # ---- operations -------------------------------------------------------------
    async def op_session(self) -> None:
        count = self.rng.randrange(100)
        if self.model.phase != "idle":
            # A resources server never refuses a seed: it waits at the door until resume.
            seed = asyncio.ensure_future(self.post("/seed_session", json={"initial_count": count}))
            self.model.tasks.append(seed)
            self.model.door_seeds.append((seed, count))
            return
        status, headers, body = await self.post("/seed_session", json={"initial_count": count})
        assert status == 200, body
        token = headers[TOKEN]
        self.model.sessions[token.split(".")[-3]] = (token, count)

    async def _seeds_after_resume(self) -> None:
        """The seeds that waited at the door go on once the participant is open."""
        for seed, count in self.model.door_seeds:
            status, headers, body = await asyncio.wait_for(seed, 10)
            assert status == 200, body
            token = headers[TOKEN]
            self.model.sessions[token.split(".")[-3]] = (token, count)
        self.model.door_seeds = []

    async def op_hold(self) -> None:
        if self.model.phase != "idle" or not self.model.sessions:
            return
        sid = self.rng.choice(sorted(self.model.sessions))
        if sid in self.model.held:
            return
        token = self.model.sessions[sid][0]
        tag = f"hold-{sid}"
        task = asyncio.ensure_future(
            self.http.get(f"{self.proxy.url}/slow?seconds=120&tag={tag}", headers={TOKEN: token})
        )
        owner = token.split(".")[-2]
        await wait_until(lambda: self.seen(owner, "/slow"), 10, "the held request to arrive")
        self.model.held[sid] = task
        self.model.held_owner[sid] = owner
        self.model.tasks.append(task)

    async def op_unhold(self) -> None:
        if not self.model.held:
            return
        sid = self.rng.choice(sorted(self.model.held))
        self.model.held.pop(sid).cancel()
        owner = self.model.held_owner.pop(sid)

        async def gone() -> bool:
            if self.model.phase != "idle":  # workers are closed: ask the coordinator
                return f"session:{sid}" not in (await self.status())["report"]["blockers"]
            async with self.http.get(f"{self.proxy.url}/cancelled", headers={OWNER: owner}) as resp:
                return f"hold-{sid}" in (await resp.json())["cancelled"]

        await wait_until(gone, 10, "the held request to be cancelled")

    async def op_episode(self) -> None:
        workers = await self.live()
        if self.model.phase != "idle" or not workers:
            return
        owner = self.rng.choice(workers)["owner"]
        self.model.serial += 1
        key = f"ep{self.seed}x{self.model.serial}"
        self.model.tasks_of[key] = f"{key}-gate"
        await self._start_run(EpisodeId(key, 0), owner)
        self.model.episodes[key] = owner

    async def _start_run(self, episode: EpisodeId, owner: str) -> None:
        """POST /run for `episode` on `owner`'s worker; return once it runs there."""
        before = await self._runs_seen(owner)
        body = {
            "_ng_rollout_id": episode.rollout_id,
            "_ng_attempt_index": episode.attempt,
            "steps": 2,
            "gate": self.model.tasks_of[episode.rollout_id],
        }
        task = asyncio.ensure_future(
            self.http.post(f"{self.proxy.url}/run", headers={OWNER: owner}, json=body)
        )
        self.model.tasks.append(task)

        async def started() -> bool:
            return await self._runs_seen(owner) > before

        await wait_until(started, 10, "the episode to start")

    async def _runs_seen(self, owner: str) -> int:
        async with self.http.get(f"{self.proxy.url}/seen", headers={OWNER: owner}) as resp:
            return (await resp.json())["paths"].count("/run")

    async def op_claim(self) -> None:
        """A replacement /run continues a restored episode as attempt N+1 (exactly once);
        sometimes it names a wrong attempt first and is refused."""
        workers = await self.live()
        if self.model.phase != "idle" or not self.model.pending or not workers:
            return
        key = self.rng.choice(sorted(self.model.pending))
        episode = parse_episode_key(key)
        if self.rng.random() < 0.3:
            wrong = episode.attempt + 1
            status, _, body = await self.post(
                "/run",
                json={
                    "_ng_rollout_id": episode.rollout_id,
                    "_ng_attempt_index": wrong,
                    "steps": 2,
                    "gate": self.model.tasks_of[episode.rollout_id],
                },
            )
            assert (status, body["error"]["code"]) == (409, "stale_attempt"), body
        owner = self.rng.choice(workers)["owner"]
        await self._start_run(episode, owner)
        self.model.pending.discard(key)
        self.model.episodes[key] = owner

    async def op_prepare(self) -> None:
        if self.model.phase not in ("idle", "preparing", "prepared"):
            return
        cid = self.model.phase == "idle" and self.cid() or self.open_id
        live = len(await self.live())
        expect = self.model.blockers(self.expected, live)
        deadline = time.time() + (1.0 if expect else 15)
        reply = await self.control.ok("prepare", checkpoint_id=cid, deadline_ts=deadline)
        self.open_id = cid
        if self.model.phase == "prepared":
            assert reply["phase"] == "prepared"  # the cached reply
            return
        assert reply["phase"] == ("preparing" if expect else "prepared"), (reply, expect)
        self.model.phase = reply["phase"]

    async def op_commit(self) -> None:
        if self.model.phase not in ("preparing", "prepared"):
            return
        directory = self.root / f"ckpt-{self.model.serial}-{len(self.model.committed)}"
        blockers = self.model.blockers(self.expected, len(await self.live()))
        candidates = sorted(set(self.model.episodes) | self.model.pending)
        scope = None
        if candidates and self.rng.random() < 0.4:
            scope = sorted(self.rng.sample(candidates, self.rng.randint(0, len(candidates))))
        body = {"checkpoint_id": self.open_id, "checkpoint_dir": str(directory)}
        if scope is not None:
            body["episode_ids"] = [parse_episode_key(k).as_json() for k in scope]
        if self.rng.random() < 0.3:
            body["stop"] = True
        status, reply = await self.control.call("commit", **body)
        if self.model.phase != "prepared" or blockers:  # commit needs a ready, prepared cut
            assert status == 409 and reply["error"]["code"] == "invalid_phase", reply
            return
        assert status == 200, reply
        self.model.phase = "committed"
        exported = set(candidates) if scope is None else set(scope)
        assert reply["episode_ids"] == sorted(exported), (reply["episode_ids"], exported)
        if scope is not None:
            self.model.pending &= set(scope)  # unclaimed outside the scope are released
        snapshot = dict(self.model.sessions)
        self.model.committed.append((directory, snapshot, exported))
        base = records.checkpoint_path(str(directory), "resources", "apps")
        _, recs = records.read(base, kind="resources", instance="apps")
        keys = {record_format.record_key(r) for r in recs if not record_format.is_session(r)}
        assert keys == exported, (keys, exported)
        assert not any(self.model.retired(k) for k in keys)

    async def op_resume(self) -> None:
        if self.model.phase == "idle":
            return
        reply = await self.control.ok("resume", checkpoint_id=self.open_id)
        assert reply == {"phase": "idle", "idempotent": False}
        self.model.phase = "idle"
        self.model.lost = False
        await self._seeds_after_resume()

    async def op_retire(self) -> None:
        """Retire a running or restored attempt, in idle or restored; everything of it and of
        earlier attempts stops and is freed, and stays refused until forget."""
        candidates = sorted(set(self.model.episodes) | self.model.pending)
        if self.model.phase not in ("idle", "restored") or not candidates:
            return
        key = self.rng.choice(candidates)
        episode = parse_episode_key(key)
        cid = self.open_id if self.model.phase == "restored" else self.cid()
        reply = await self.control.ok("retire", checkpoint_id=cid, episode_ids=[episode.as_json()])
        assert reply == {"retired": [key]}
        mark = self.model.marks.get(episode.rollout_id, -1)
        self.model.marks[episode.rollout_id] = max(mark, episode.attempt)
        for gone in [k for k in self.model.episodes if self.model.retired(k)]:
            del self.model.episodes[gone]
        self.model.pending = {k for k in self.model.pending if not self.model.retired(k)}

    async def op_late(self) -> None:
        """A request of a retired attempt (or an earlier one) arrives late: refused."""
        if self.model.phase != "idle" or not self.model.marks:
            return
        rollout_id = self.rng.choice(sorted(self.model.marks))
        attempt = self.rng.randint(0, self.model.marks[rollout_id])
        status, _, body = await self.post(
            "/run",
            json={"_ng_rollout_id": rollout_id, "_ng_attempt_index": attempt, "steps": 2},
        )
        assert (status, body["error"]["code"]) == (409, "stale_attempt"), body

    async def op_forget(self) -> None:
        if self.model.phase not in ("idle", "restored") or not self.model.marks:
            return
        rollout_id = self.rng.choice(sorted(self.model.marks))
        cid = self.open_id if self.model.phase == "restored" else self.cid()
        reply = await self.control.ok("forget", checkpoint_id=cid, rollout_ids=[rollout_id])
        assert reply == {"forgotten": [rollout_id]}
        del self.model.marks[rollout_id]

    async def op_kill(self) -> None:
        workers = await self.live()
        if len(workers) < 2 or self.model.held_back:
            return
        victim = self.rng.choice(workers)
        self.hold.write_text("held back")
        os.kill(victim["pid"], signal.SIGKILL)
        await wait_until(lambda: self._live_count(len(workers) - 1), 10, "the kill to be seen")
        self.model.held_back += 1
        self.model.door_seeds = []  # a seed waiting on the killed worker fails: not modelled
        if self.model.phase != "idle":
            self.model.lost = True
        if self.model.phase == "prepared":
            self.model.phase = "preparing"  # a lost worker undoes a successful prepare
        owner = victim["owner"]
        for sid in [s for s, (t, _) in self.model.sessions.items() if t.split(".")[-2] == owner]:
            del self.model.sessions[sid]
            self.model.held.pop(sid, None)
            self.model.held_owner.pop(sid, None)
        for key in [k for k, o in self.model.episodes.items() if o == owner]:
            del self.model.episodes[key]

    async def _live_count(self, count: int) -> bool:
        return len(await self.live()) == count

    async def op_join(self) -> None:
        if not self.model.held_back:
            return
        self.hold.unlink()
        await wait_until(lambda: self._live_count(self.expected), 20, "the late join")
        self.model.held_back = 0
        if self.model.phase in ("preparing", "prepared"):
            # the newcomer closes its gate and reports; until then it is unreported
            await wait_until(self._all_reported, 10, "the late worker's first report")

    async def _all_reported(self) -> bool:
        blockers = (await self.status())["report"]["blockers"]
        return not any(b.startswith("resources-workers-unreported") for b in blockers)

    async def op_restore(self) -> None:
        if not self.model.committed:
            return
        directory, snapshot, episodes = self.model.committed[-1]
        for task in self.model.tasks:
            task.cancel()
        self.proxy.kill_all()
        self.last_log = self.proxy.log()
        self.proxy.close()
        if self.hold.exists():
            self.hold.unlink()
        self.start(self.rng.randint(1, 3))
        chosen = sorted(episodes)
        if chosen and self.rng.random() < 0.4:
            chosen = sorted(self.rng.sample(chosen, self.rng.randint(0, len(chosen))))
        ids = [parse_episode_key(k).as_json() for k in chosen]
        cid = self.cid()
        reply = await self.control.ok(
            "restore", checkpoint_id=cid, checkpoint_dir=str(directory), episode_ids=ids
        )
        continued = {parse_episode_key(k).next_attempt().key for k in chosen}
        assert reply["restored"] == sorted(continued), (reply, continued)
        self.model = Model(
            serial=self.model.serial,
            committed=self.model.committed,
            tasks_of=self.model.tasks_of,
            pending=continued,
            phase="restored",
        )
        self.open_id = cid
        # in restored, a controller may still discard attempts (NeMo-RL's discard_restored)
        if continued and self.rng.random() < 0.3:
            await self.op_retire()
        await self.control.ok("resume", checkpoint_id=cid)
        self.model.phase = "idle"
        for sid, (token, count) in snapshot.items():
            status, headers, body = await self.post("/get_counter_value", headers={TOKEN: token})
            assert status == 200, (sid, status, body)
            assert body["count"] == count, (sid, body)
            assert TOKEN not in headers  # tokens stay valid for life
            self.model.sessions[sid] = (token, count)

    # ---- invariants -------------------------------------------------------------
    async def check(self) -> None:
        status = await self.status()
        assert status["phase"] == self.model.phase, (status["phase"], self.model.phase)
        assert status["restored_pending"] == sorted(self.model.pending), status
        assert status["retired_rollouts"] == len(self.model.marks), status
        live = status["workers"]
        if self.model.phase == "idle":
            for worker in live:  # admission is open on every live worker
                code, _, body = await self.post("/whoami", headers={OWNER: worker["owner"]})
                assert code == 200, body
        elif self.model.phase in ("preparing", "prepared"):
            report = status["report"]
            expect = self.model.blockers(self.expected, len(live))
            assert sorted(report["blockers"]) == sorted(expect), (report, expect)
            assert report["blocker_count"] == len(expect)

    async def run(self) -> None:
        operations = [
            (self.op_session, 4),
            (self.op_hold, 2),
            (self.op_unhold, 2),
            (self.op_episode, 2),
            (self.op_prepare, 3),
            (self.op_commit, 3),
            (self.op_resume, 3),
            (self.op_retire, 1),
            (self.op_late, 1),
            (self.op_forget, 1),
            (self.op_claim, 2),
            (self.op_kill, 1),
            (self.op_join, 1),
            (self.op_restore, 1),
        ]
        functions, weights = zip(*operations, strict=True)
        self.start(self.rng.randint(1, 3))
        try:
            for _ in range(STEPS):
                operation = self.rng.choices(functions, weights)[0]
                self.trail.append(operation.__name__)
                await operation()
                await self.check()
            for directory, _, _ in self.model.committed:
                base = records.checkpoint_path(str(directory), "resources", "apps")
                records.read(base, kind="resources", instance="apps")
        finally:
            for task in self.model.tasks:
                task.cancel()
            for result in await asyncio.gather(*self.model.tasks, return_exceptions=True):
                if isinstance(result, aiohttp.ClientResponse):
                    result.release()
            self.last_log = self.proxy.log()
            self.proxy.close()


@pytest.mark.timeout(max(600, SEEDS * 6))
async def test_random_operations(tmp_path):
    async with aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout(total=30)
    ) as http:
        limit = asyncio.Semaphore(PARALLEL)

        async def one(seed: int) -> None:
            async with limit:
                root = tmp_path / f"seed-{seed}"
                root.mkdir()
                try:
                    walk = Walk(seed, http, root)
                    await walk.run()
                except BaseException as exc:
                    raise AssertionError(
                        f"seed {seed} failed after {walk.trail}: {exc!r}\n"
                        f"last gym-proxy log:\n{walk.last_log[-3000:]}"
                    ) from exc

        await asyncio.gather(*(one(seed) for seed in range(FIRST_SEED, FIRST_SEED + SEEDS)))

"""Crafted checkpoints (valid digests, hostile fields or files) and bad control input:
always a JSON 4xx, never a plain-text 500, and the participant is left idle and open."""

from __future__ import annotations

import asyncio
import errno
import os
import time

import orjson
import pytest

from gym_proxy.coordinator import checkpoint_files as records
from gym_proxy.proxy.data_path.session_tokens import TokenCodec
from tests.raw_http import close, open_raw, read_responses
from tests.support import CONTROL_TOKEN, TEST_SECRET, Control, v1_token, write_checkpoint

TOKEN = "X-NeMo-Gym-Session-Token"
GOOD_SESSION = {"episode_id": None, "session_id": "s1", "state": 1, "owner": "o1"}
GOOD_EPISODE = {
    "episode_id": {"rollout_id": "r1", "attempt": 0},
    "task_digest": "",
    "boundary": {"step": 1},
}


def craft(directory, lines: list[bytes], **manifest_fields) -> None:
    """A checkpoint whose digest and count match `lines`, with manifest fields overridden
    (a field given as "<absent>" is left out)."""
    fields = {
        "kind": "resources",
        "instance": "apps",
        "checkpoint_id": "crafted",
        "session_owners": {"o1": "o1"},
        "assigned_sessions": {},
        "assigned_app_sessions": {},
        **manifest_fields,
    }
    write_checkpoint(records.checkpoint_path(str(directory), "resources", "apps"), lines, **fields)


def record(**changes) -> bytes:
    base = GOOD_EPISODE if changes.pop("episode_record", False) else GOOD_SESSION
    merged = {**base, **changes}
    return orjson.dumps({k: v for k, v in merged.items() if v != "<absent>"})


CRAFTED: dict[str, tuple[list[bytes], dict]] = {
    "session_owners-value-list": ([record()], {"session_owners": {"o1": ["o1"]}}),
    "session_owners-value-int": ([record()], {"session_owners": {"o1": 7}}),
    "session_owners-a-list-of-ints": ([record()], {"session_owners": [1]}),
    "session_owners-a-string": ([record()], {"session_owners": "o1"}),
    "session_owners-bad-key": ([record()], {"session_owners": {"a/b": "o1"}}),
    "assigned_sessions-value-int": ([record()], {"assigned_sessions": {"s1": 3}}),
    "record_count-a-string": ([record()], {"record_count": "1"}),
    "checkpoint_id-missing": ([record()], {"checkpoint_id": "<absent>"}),
    "record_count-missing": ([record()], {"record_count": "<absent>"}),
    # A manifest of gym-proxy's (it has a placed table) holds all three of its extras.
    "session_owners-missing": ([record()], {"session_owners": "<absent>"}),
    "assigned_sessions-missing": ([record()], {"assigned_sessions": "<absent>"}),
    "assigned_app_sessions-missing": ([record()], {"assigned_app_sessions": "<absent>"}),
    "session_id-missing": ([record(session_id="<absent>")], {}),
    "session_id-an-int": ([record(session_id=5)], {}),
    "session_id-with-a-slash": ([record(session_id="../x")], {}),
    "owner-a-list": ([record(owner=["o1"])], {}),
    "owner-an-int": ([record(owner=1)], {}),
    "session-episode_id-an-int": ([record(episode_id=3)], {}),
    "session-episode_id-a-key-string": ([record(episode_id="r1-a1")], {}),
    "episode-without-rollout_id": ([record(episode_record=True, episode_id={"attempt": 0})], {}),
    "episode-rollout_id-a-list": (
        [record(episode_record=True, episode_id={"rollout_id": ["r"], "attempt": 0})],
        {},
    ),
    "episode-attempt-a-string": (
        [record(episode_record=True, episode_id={"rollout_id": "r", "attempt": "1"})],
        {},
    ),
    "episode-attempt-negative": (
        [record(episode_record=True, episode_id={"rollout_id": "r", "attempt": -1})],
        {},
    ),
    "episode-attempt-a-bool": (
        [record(episode_record=True, episode_id={"rollout_id": "r", "attempt": True})],
        {},
    ),
    "episode-task_digest-an-int": ([record(episode_record=True, task_digest=7)], {}),
    "record-a-list": ([b"[1, 2]"], {}),
    "record-of-no-known-shape": ([orjson.dumps({"kind": "blob"})], {}),
    # gym-proxy's pre-release record shapes: no release wrote them, nothing reads them.
    "type-session-record": (
        [orjson.dumps({"type": "session", "session_id": "s1", "owner": "o1", "value": 1})],
        {},
    ),
    "type-episode-record": (
        [orjson.dumps({"type": "episode", "rollout_id": "r1", "attempt": 0, "state": {}})],
        {},
    ),
    "session-without-state": ([record(state="<absent>")], {}),
    "valid-then-invalid": ([record(), record(session_id="s2", owner={"x": 1})], {}),
    # Lines whose two ends read right: their worker parses them whole and refuses them.
    "state-not-json": (
        [record(), b'{"episode_id":null,"session_id":"s2","state":{,"owner":"o1"}'],
        {},
    ),
    "session_id-twice": (
        [b'{"episode_id":null,"session_id":"s1","state":1,"session_id":"s9","owner":"o1"}'],
        {},
    ),
}

REFUSED_AT_INSTALL = {
    "state-not-json": "line 2 is not JSON",
    "session_id-twice": "line 1 holds other IDs than its first and last fields",
}
# The whole detail of a refusal that names a missing field: one line, the field named.
MISSING = {
    name: f"manifest has no field {name.removesuffix('-missing')}"
    for name in CRAFTED
    if name.endswith("-missing") and not name.startswith("session_id")
}


@pytest.fixture
def restorer(start_proxy):
    # A restore that fails installs nothing, so one fresh participant serves every case.
    return start_proxy(workers=2, control_token=CONTROL_TOKEN)


async def assert_idle_and_open(control, http, url):
    status = await control.ok("status")
    assert status["phase"] == "idle" and status["restored_pending"] == [], status
    assert status["session_aliases"] == {}
    async with http.post(f"{url}/seed_session", json={}) as resp:
        assert resp.status == 200  # admission is open


async def test_crafted_fields_are_422(restorer, http, tmp_path):
    control = Control(http, restorer.url)
    for name, (lines, fields) in CRAFTED.items():
        directory = tmp_path / name
        craft(directory, lines, **fields)
        code, body = await control.call(
            "restore",
            checkpoint_id=f"r-{name}",
            checkpoint_dir=str(directory),
            episode_ids=[{"rollout_id": "r1", "attempt": 0}],
        )
        assert code == 422, (name, code, body)
        assert body["error"]["code"] == "invalid_checkpoint_state", name
        if name in MISSING:
            assert body["error"]["detail"] == MISSING[name], body
        if name in REFUSED_AT_INSTALL:  # by a worker: the install is undone everywhere
            assert REFUSED_AT_INSTALL[name] in body["error"]["detail"], body
            assert body["error"]["detail"].endswith("nothing was installed"), body
        await assert_idle_and_open(control, http, restorer.url)


async def test_special_files_are_refused_without_blocking(restorer, http, tmp_path):
    control = Control(http, restorer.url)
    cases = {}
    fifo_records = tmp_path / "fifo-records"
    craft(fifo_records, [record()])
    base = records.checkpoint_path(str(fifo_records), "resources", "apps")
    [data_file] = base.glob("records-*.jsonl")
    data_file.unlink()
    os.mkfifo(data_file)
    cases["records-a-fifo"] = fifo_records
    fifo_manifest = tmp_path / "fifo-manifest"
    craft(fifo_manifest, [record()])
    base = records.checkpoint_path(str(fifo_manifest), "resources", "apps")
    (base / "manifest.json").unlink()
    os.mkfifo(base / "manifest.json")
    cases["manifest-a-fifo"] = fifo_manifest
    dir_records = tmp_path / "dir-records"
    craft(dir_records, [record()])
    base = records.checkpoint_path(str(dir_records), "resources", "apps")
    [data_file] = base.glob("records-*.jsonl")
    data_file.unlink()
    data_file.mkdir()
    cases["records-a-directory"] = dir_records
    device = tmp_path / "device-manifest"
    craft(device, [record()])
    base = records.checkpoint_path(str(device), "resources", "apps")
    (base / "manifest.json").unlink()
    (base / "manifest.json").symlink_to("/dev/zero")
    cases["manifest-a-device"] = device
    for name, directory in cases.items():
        started = time.monotonic()
        restore = asyncio.ensure_future(
            control.call(
                "restore", checkpoint_id=f"r-{name}", checkpoint_dir=str(directory), episode_ids=[]
            )
        )
        # a concurrent control call is not held up by it
        resumed = await asyncio.wait_for(control.call("resume", checkpoint_id="other"), 5)
        assert resumed[0] == 200
        code, body = await asyncio.wait_for(restore, 5)
        assert (code, body["error"]["code"]) == (422, "invalid_checkpoint_state"), name
        assert time.monotonic() - started < 5
        await assert_idle_and_open(control, http, restorer.url)


async def raw_control(proxy, request: bytes):
    reader, writer = await open_raw(proxy)
    writer.write(request)
    responses = await read_responses(reader, 1)
    await close(writer)
    [(status, headers, body)] = responses
    assert headers[b"content-type"].startswith(b"application/json"), (status, body)
    return status, orjson.loads(body)["error"]["code"]


async def test_bad_control_input_is_json_never_a_500(restorer, http):
    path = "/ng-control/v1/checkpoint"
    body = orjson.dumps({"checkpoint_id": "x", "deadline_ts": time.time() + 30})

    def post(target: str, payload: bytes, auth: bytes = b"Bearer " + CONTROL_TOKEN.encode()):
        return (
            b"POST " + target.encode() + b" HTTP/1.1\r\nHost: t\r\nAuthorization: " + auth
            + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload)
            + payload
        )  # fmt: skip

    cases = [
        (post(f"{path}/prepare", body, b"Bearer t\xc3\xa9st\xff\xfe"), (401, "unauthorized")),
        (post(f"{path}/prepare", body, b"Bearer \xff"), (401, "unauthorized")),
        (post(f"{path}/prepare", body, b"Basic abc"), (401, "unauthorized")),
        (
            post(
                f"{path}/commit",
                orjson.dumps(
                    {
                        "checkpoint_id": "x",
                        "deadline_ts": time.time() + 30,
                        "checkpoint_dir": "/a\0b",
                    }
                ),
            ),
            (400, "invalid_request"),
        ),
        (
            post(f"{path}/prepare", orjson.dumps({"checkpoint_id": "x", "deadline_ts": 1e308})),
            (400, "invalid_request"),
        ),
        (
            post(
                f"{path}/retire",
                orjson.dumps(
                    {
                        "checkpoint_id": "x",
                        "deadline_ts": -1e308,
                        "episode_ids": [{"rollout_id": "r", "attempt": 0}],
                    }
                ),
            ),
            (409, "deadline_exceeded"),
        ),
        (post(f"{path}/nothing", body), (404, "not_found")),
        (post(f"{path}/status", body), (405, "method_not_allowed")),
        (post(f"{path}/prepare", b"\xff\xfe{"), (400, "invalid_request")),
    ]
    for request, expected in cases:
        assert await raw_control(restorer, request) == expected, request[:90]
    status = await Control(http, restorer.url).ok("status")
    assert status["phase"] == "idle"


def test_disk_full_leaves_no_files_behind(tmp_path, monkeypatch):
    """A write that fails (ENOSPC at the manifest's fsync) removes its temp files and the
    records file it created, and says so with OSError."""
    base = records.checkpoint_path(str(tmp_path), "resources", "inst")
    real_fsync = os.fsync
    calls = []

    def full(fd):
        calls.append(fd)
        if len(calls) == 2:  # the records file synced; the manifest's sync hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as err:
        records.write(
            base,
            kind="resources",
            instance="inst",
            checkpoint_id="c",
            records=[GOOD_SESSION],
            extras={"session_owners": {}, "assigned_sessions": {}, "assigned_app_sessions": {}},
        )
    assert err.value.errno == errno.ENOSPC
    assert list(base.iterdir()) == []


async def test_restored_owners_route_this_instances_tokens_and_never_a_v1_token(
    in_process, http, tmp_path, test_app
):
    """Restored onto new workers, the owners of the checkpoint are aliased: this
    instance's tokens naming them reach their sessions. The pre-release `v1.` token,
    signed with the same secret and naming the same session and owner (in the
    `ng_session` cookie or this instance's), reaches none: a new, empty session."""
    lines = [
        orjson.dumps(
            {"episode_id": None, "session_id": f"s{i}", "state": 10 * i + 5, "owner": owner}
        )
        for i, owner in enumerate(["old1", "old1", "old2"])
    ]
    craft(tmp_path, lines, session_owners={"old1": "old1", "old2": "old2"})
    proxy = await in_process(workers=2, control_token=CONTROL_TOKEN, app=test_app)
    control = Control(http, proxy.url)
    await control.ok("restore", checkpoint_id="old", checkpoint_dir=str(tmp_path), episode_ids=[])
    await control.ok("resume", checkpoint_id="old")
    codec = TokenCodec(TEST_SECRET.encode(), "apps")  # this instance (--name apps)
    for i, owner in enumerate(["old1", "old1", "old2"]):
        token = codec.sign(f"s{i}", owner)
        async with http.post(f"{proxy.url}/get_counter_value", headers={TOKEN: token}) as resp:
            assert (resp.status, await resp.json()) == (200, {"count": 10 * i + 5}), i
        old = v1_token(TEST_SECRET.encode(), f"s{i}", owner)
        for cookie in (f"ng_session={old}", f"{proxy.cookie}={old}"):
            async with http.post(
                f"{proxy.url}/get_counter_value", headers={"Cookie": cookie}
            ) as resp:
                assert (resp.status, await resp.json()) == (200, {"count": 0}), (i, cookie)
                assert "ng_session" not in resp.cookies and proxy.cookie in resp.cookies

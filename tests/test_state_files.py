"""The runtime directory's state files believe only what this user wrote
(coordinator/contract/state_files.py, coordinator/contract/trust.py): a FIFO, a link,
another user's file or an oversized one is refused in one line without blocking, a
temporary file is never written through a planted link, a count is bounded, and a
missing file is no warning."""

from __future__ import annotations

import logging
import os
import socket
import stat

import pytest

from gym_proxy.coordinator import claims_recovery
from gym_proxy.coordinator.contract import state_files
from gym_proxy.coordinator.contract.state_files import (
    UnreadableDocument,
    read_document,
    replace_document,
)
from gym_proxy.coordinator.contract.trust import Untrusted, own_peer, private_directory
from gym_proxy.proxy.fleet.supervision.intent import (
    INTENT_NAME,
    FleetIntent,
    load_intent,
    save_intent,
)
from gym_proxy.proxy.runtime_dir import IDENTITY_NAME, RuntimeDir, RuntimeDirBusy, adoptable_name

pytestmark = [pytest.mark.fast, pytest.mark.timeout(20)]  # a blocking open hangs, not fails

NOBODY = 65534
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="making another user's file needs root")


def refused(path, why: str) -> None:
    with pytest.raises(UnreadableDocument, match=why) as raised:
        read_document(path)
    assert "\n" not in str(raised.value) and str(path) in str(raised.value)


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path):
    for name in (INTENT_NAME, IDENTITY_NAME, claims_recovery.RESTORED_NAME):
        os.mkfifo(tmp_path / name)
        refused(tmp_path / name, "is not a regular file")


def test_a_link_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_bytes(b'{"workers": 3, "drained": []}')
    os.symlink(target, tmp_path / INTENT_NAME)
    refused(tmp_path / INTENT_NAME, "is a symbolic link")


def test_a_file_over_the_size_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(state_files, "MAX_SIZE", 64)
    (tmp_path / INTENT_NAME).write_bytes(b" " * 65 + b"{}")
    refused(tmp_path / INTENT_NAME, "bytes, over 64")


@needs_root
def test_another_users_file_is_refused(tmp_path):
    path = tmp_path / INTENT_NAME
    path.write_bytes(b'{"workers": 2, "drained": []}')
    os.chown(path, NOBODY, NOBODY)
    refused(path, f"belongs to uid {NOBODY}, not to this user")


def test_a_world_writable_file_is_refused(tmp_path):
    path = tmp_path / INTENT_NAME
    path.write_bytes(b'{"workers": 2, "drained": []}')
    os.chmod(path, 0o666)
    refused(path, "is writable by other users")


def test_a_missing_file_is_none_and_damaged_json_says_so(tmp_path):
    assert read_document(tmp_path / "absent.json") is None
    (tmp_path / "half.json").write_bytes(b'{"workers": ')
    refused(tmp_path / "half.json", "is not JSON")


@pytest.mark.parametrize("name", [INTENT_NAME, IDENTITY_NAME])
def test_a_planted_link_at_the_temporary_name_is_never_written_through(tmp_path, name):
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    os.symlink(outside, runtime / f"{name}.tmp")  # the name earlier versions wrote
    replace_document(runtime / name, {"instance": "x", "workers": 1, "drained": []})
    assert outside.read_bytes() == b"precious"
    written = read_document(runtime / name)
    assert written is not None and written["instance"] == "x"
    assert stat.S_IMODE(os.stat(runtime / name).st_mode) == 0o600
    left = sorted(p.name for p in runtime.iterdir())
    assert left == sorted([name, f"{name}.tmp"]), left  # no temporary of its own left


def test_a_fleet_intent_of_100000_workers_is_refused_in_one_line(tmp_path, caplog):
    save_intent(str(tmp_path), FleetIntent(100000))
    with caplog.at_level(logging.WARNING):
        assert load_intent(str(tmp_path)) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "names 100000 workers, not 1-256" in lines[0], lines


def test_a_fleet_intent_in_a_fifo_is_said_and_ignored(tmp_path, caplog):
    os.mkfifo(tmp_path / INTENT_NAME)
    with caplog.at_level(logging.WARNING):
        assert load_intent(str(tmp_path)) is None
    assert "is not a regular file: the command line's worker count" in caplog.text


def test_no_restore_note_is_no_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert claims_recovery.recall(str(tmp_path / claims_recovery.RESTORED_NAME)) is None
    assert caplog.records == []


def test_a_restore_note_in_a_fifo_is_one_line(tmp_path, caplog):
    path = tmp_path / claims_recovery.RESTORED_NAME
    os.mkfifo(path)
    with caplog.at_level(logging.WARNING):
        assert claims_recovery.recall(str(path)) is None
    assert len(caplog.records) == 1, caplog.text
    assert "is not a regular file: restored episodes cannot be continued" in caplog.text


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "instance.json is missing"),
        (b'{"instance": "ap', "instance.json is not JSON"),
        (b'["apps"]', "instance.json is not an identity file"),
        ("fifo", "instance.json is not a regular file"),
    ],
)
def test_a_directory_without_an_identity_to_believe_says_why(tmp_path, content, why):
    name = adoptable_name("apps", "127.0.0.1:1")
    (tmp_path / name).mkdir(mode=0o700)
    identity = tmp_path / name / IDENTITY_NAME
    if content == "fifo":
        os.mkfifo(identity)
    elif content is not None:
        identity.write_bytes(content)
    runtime = RuntimeDir(str(tmp_path), name)
    try:
        assert runtime.found is None and runtime.unidentified is not None
        assert why in runtime.unidentified and "\n" not in runtime.unidentified
    finally:
        runtime.remove()


@needs_root
def test_another_users_directory_is_not_adopted_from(tmp_path):
    name = adoptable_name("apps", "127.0.0.1:1")
    (tmp_path / name).mkdir(mode=0o755)
    os.chown(tmp_path / name, NOBODY, NOBODY)
    with pytest.raises(Untrusted, match=f"belongs to uid {NOBODY}"):
        private_directory(str(tmp_path / name))
    with pytest.raises(RuntimeDirBusy, match=f"belongs to uid {NOBODY}"):
        RuntimeDir(str(tmp_path), name)


def test_a_group_writable_directory_is_not_private(tmp_path):
    (tmp_path / "d").mkdir()
    os.chmod(tmp_path / "d", 0o770)
    with pytest.raises(Untrusted, match="is writable by other users"):
        private_directory(str(tmp_path / "d"))


def test_a_peer_of_this_user_is_believed():
    ours, theirs = socket.socketpair(socket.AF_UNIX)
    with ours, theirs:
        assert own_peer(ours, "a pair").pid == os.getpid()

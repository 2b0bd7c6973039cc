"""Unit tests of the ground floor (`coordinator.contract`): the channel messages, retire
marks and restored claims, the ID rules and the /ng-rollout/ split, and that the floor
imports nothing above it."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gym_proxy.coordinator.contract import messages
from gym_proxy.coordinator.contract.episodes import (
    EpisodeId,
    check_rollout_id,
    check_rollout_ids,
)
from gym_proxy.coordinator.contract.errors import GymError
from gym_proxy.coordinator.contract.headers import split_rollout_path, split_rollout_url
from gym_proxy.coordinator.contract.ids import is_checkpoint_id, is_rollout_id, is_valid_id
from gym_proxy.coordinator.contract.marks import RestoredClaims, RetireMarks
from gym_proxy.coordinator.contract.messages import MESSAGES, MalformedMessage, Message, Request

pytestmark = pytest.mark.fast

CONTRACT = Path(__file__).resolve().parent.parent / "coordinator" / "contract"

# A value of the right type for every field shape the messages use.
SAMPLES: dict[str, Any] = {
    "int": 3,
    "float": 0.25,
    "str": "x",
    "bool": True,
    "bytes": b"raw",
    "Any": {"step": 1},
    "str | None": None,
    "list[str]": ["a"],
    "list[int]": [3],
    "list[str] | None": ["k"],
    "dict[str, int]": {"a": 1},
    "dict[str, float]": {"a": 1.5},
    "dict[str, list[str]]": {"a": ["b"]},
    "dict[str, str]": {"k": "v"},
    "list[RunningEpisode]": [messages.RunningEpisode("k", None, ["s"], "")],
    "list[dict[str, Any]]": [{"session_id": "s"}],
    "list[EpisodeRef]": [messages.EpisodeRef("r", 1)],
    "Literal['aiohttp', 'asgi']": "asgi",
}


def sample(cls: type[Message]) -> Message:
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # message() made it a dataclass
        nested = messages._NESTED.get((cls, f.name))
        values[f.name] = sample(nested) if nested is not None else SAMPLES[str(f.type)]
    return cls(**values)


@pytest.mark.parametrize("kind", sorted(MESSAGES))
def test_every_message_and_its_reply_survive_the_wire(kind):
    request = sample(MESSAGES[kind])
    classes = [MESSAGES[kind]]
    if isinstance(request, Request):
        classes.append(request.REPLY)
    for cls in classes:
        original = sample(cls)
        wire = {**original.wire(), "id": 7}
        assert cls.decode(wire) == original
        if cls.TYPE:
            assert messages.decode(wire) == original


@pytest.mark.parametrize("kind", sorted(k for k, c in MESSAGES.items() if c._required))
def test_a_missing_or_unknown_key_fails_at_decode_naming_the_message(kind):
    wire = sample(MESSAGES[kind]).wire()
    key = sorted(MESSAGES[kind]._required)[0]
    with pytest.raises(MalformedMessage, match=rf"^{kind}: missing key\(s\) {key}$"):
        messages.decode({k: v for k, v in wire.items() if k != key})
    with pytest.raises(MalformedMessage, match=rf"^{kind}: unknown key\(s\) surplus$"):
        messages.decode({**wire, "surplus": 1})


def test_mistyped_values_fail_at_decode():
    good = messages.Claim("r1", 2, "d").wire()
    for key, value in (("attempt", True), ("attempt", "2"), ("rollout_id", None)):
        with pytest.raises(MalformedMessage, match=rf"^claim: {key} is not"):
            messages.decode({**good, key: value})
    reply = messages.RegisterReply(messages.Tables({}, {}), None).fields()
    with pytest.raises(MalformedMessage, match="Tables: unknown key"):
        messages.RegisterReply.decode({**reply, "tables": {"pending": {}, "marks": {}, "x": 1}})
    retire = {"type": "retire", "episode_ids": [{"rollout_id": "r", "attempt": 1}]}
    assert messages.decode(retire) == messages.Retire([messages.EpisodeRef("r", 1)])
    with pytest.raises(MalformedMessage, match="^EpisodeRef: missing key"):
        messages.decode({"type": "retire", "episode_ids": [{"rollout_id": "r"}]})
    with pytest.raises(MalformedMessage, match="^retire: episode_ids is not a list of EpisodeRef"):
        messages.decode({"type": "retire", "episode_ids": ["r-a1"]})
    with pytest.raises(MalformedMessage, match="unknown message type 'nope'"):
        messages.decode({"type": "nope"})


def test_a_second_definition_of_a_message_type_is_refused():
    with pytest.raises(ValueError, match="two definitions of channel message 'claim'"):

        @messages.message("claim")
        class Again(Message):
            pass


def test_a_request_names_its_reply_in_its_base():
    assert messages.Close("c").REPLY is messages.CloseReply
    assert messages.TablesUpdate({}, {}).REPLY is messages.Done
    assert not isinstance(messages.Ready(1, None, True, [], {}, []), Request)  # a notice
    registry: dict[str, type[Message]] = {}
    with pytest.raises(TypeError, match="Bare: a request names its reply"):

        @messages.message("bare", registry=registry)
        class Bare(Request):  # no reply named: the refusal under test
            pass

    with pytest.raises(TypeError, match="NotAMessage: the reply of a request is a Message"):

        @messages.message("not_a_message", registry=registry)
        class NotAMessage(Request[int]):  # type: ignore[type-var]  # the refusal under test
            pass

    @messages.message("inherits", registry=registry)
    class Inherits(messages.Close):
        pass

    assert Inherits("c").REPLY is messages.CloseReply and registry == {"inherits": Inherits}


def test_retire_marks_cover_the_attempt_and_every_earlier_one():
    marks = RetireMarks()
    marks.retire([EpisodeId("r", 2)])
    assert [marks.covers(EpisodeId("r", a)) for a in range(4)] == [True, True, True, False]
    marks.retire([EpisodeId("r", 1)])  # marks never go back
    assert marks.covers(EpisodeId("r", 2)) and not marks.covers(EpisodeId("other", 0))
    marks.merge({"r": 0, "s": 5})
    assert marks.as_dict() == {"r": 2, "s": 5} and len(marks) == 2
    marks.forget(["r", "unknown"])
    assert not marks.covers(EpisodeId("r", 0)) and marks.as_dict() == {"s": 5}


def test_restored_claims_are_handed_out_once_and_only_to_the_continuing_attempt():
    claims: RestoredClaims[str] = RestoredClaims({"r1": (1, "rec1"), "r2": (3, "rec2")})
    with pytest.raises(GymError, match="r1 continues only as attempt 1") as wrong:
        claims.check(EpisodeId("r1", 0))
    assert wrong.value.code == "stale_attempt"
    assert claims.check(EpisodeId("r1", 1)) == "rec1"
    claims.take("r1")
    with pytest.raises(GymError, match="r1 has no unclaimed restored record"):
        claims.check(EpisodeId("r1", 1))
    assert "r2" in claims and claims.keys() == ["r2-a3"] and claims.attempts() == {"r2": 3}


def test_restored_claims_drop_what_marks_cover_and_what_a_scope_leaves_out():
    claims: RestoredClaims[None] = RestoredClaims({"a": (1, None), "b": (2, None), "c": (0, None)})
    marks = RetireMarks({"a": 1, "b": 1})
    assert claims.drop_retired(marks) == [EpisodeId("a", 1)]  # b continues as 2: not covered
    claims.keep_only({"b-a2"})
    assert claims.attempts() == {"b": 2}


def test_id_rules():
    assert is_valid_id("-P1SBqWaCxk") and not is_valid_id("a.b") and not is_valid_id("x" * 65)
    assert is_checkpoint_id("ck-1.r") and not is_checkpoint_id(".hidden")
    assert is_rollout_id("12-3") and not is_rollout_id(5) and not is_rollout_id("_x")
    assert check_rollout_id("task.7") == "task.7"
    for bad in ("r-a3", "x" * 513, "", None):
        with pytest.raises(GymError):
            check_rollout_id(bad)


@pytest.mark.parametrize(
    "values",
    [
        [],
        ["task.7", "12-3", "x" * 512, "a-a", "r-ab1"],
        ["ok", "r-a3"],
        ["ok", "x" * 513],
        ["ok", ""],
        ["ok", None],
        ["a\nb"],  # a newline would split one ID into two lines
        ["ok\n"],
        ["ok", "_x"],
        ["ok", "caf\u00e9"],
    ],
)
def test_rollout_ids_checked_at_once_as_one_by_one(values):
    """The one-pass check accepts and refuses what the per-ID check does, naming the same
    first wrong ID."""

    def outcome(check: Callable[[], object]) -> tuple[str, object]:
        try:
            return "ok", check()
        except GymError as exc:
            return exc.code, exc.detail

    assert outcome(lambda: check_rollout_ids(values)) == outcome(
        lambda: [check_rollout_id(v) for v in values]
    )


def test_the_rollout_prefix_splits_the_same_on_both_floors():
    assert split_rollout_url(b"/ng-rollout/r1-a2/run?x=1") == (b"r1-a2", b"/run?x=1")
    assert split_rollout_url(b"/ng-rollout/r1?x") == (b"r1", b"/?x")
    assert split_rollout_url(b"/ng-rollout//run")[0] == b""
    assert split_rollout_path("/ng-rollout/r1-a2/run") == ("r1-a2", "/run")
    assert split_rollout_path("/ng-rollout/r1") == ("r1", "/")
    assert split_rollout_path("/run") == (None, "/run")
    with pytest.raises(GymError) as empty:
        split_rollout_path("/ng-rollout//run")
    assert empty.value.code == "bad_request"


def test_the_ground_floor_imports_nothing_above_it():
    # Read as text, not with `ast`: CPython 3.11's ast raised a spurious SystemError here
    # once, deep in a long pytest run ("AST constructor recursion depth mismatch").
    imports = re.compile(r"^\s*(?:from|import)\s+([\w.]+)", re.MULTILINE)
    for path in sorted(CONTRACT.glob("*.py")):
        for name in imports.findall(path.read_text()):
            if name.split(".")[0] == "gym_proxy":
                assert name.startswith("gym_proxy.coordinator.contract"), (
                    f"{path.name} imports {name}"
                )

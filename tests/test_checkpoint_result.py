"""The controller's account of a checkpoint, in process: restarts by participant, a partial
checkpoint that says so, gym-proxy-ctl's exit status, --server and --help."""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gym_proxy.coordinator.clients.checkpoint_result import CheckpointResult
from gym_proxy.coordinator.clients.controller import (
    ControlFailed,
    Controller,
    Participant,
    PrepareResult,
)
from gym_proxy.coordinator.clients.controller_cli import _parser, _server, exit_status
from gym_proxy.coordinator.contract.answers import (
    CommitAnswer,
    Manifest,
    PrepareAnswer,
    ReadinessReport,
)
from gym_proxy.coordinator.contract.episodes import EpisodeId
from gym_proxy.coordinator.contract.exit_codes import CHECKPOINT_PARTIAL

pytestmark = pytest.mark.fast


def prepared(restarts: dict[str, list[str]]) -> PrepareResult:
    return PrepareResult(
        True,
        {
            url: PrepareAnswer("prepared", ReadinessReport(True, [], 0, {}, keys))
            for url, keys in restarts.items()
        },
    )


def commit_answer(checkpoint_id: str = "ck3") -> CommitAnswer:
    manifest = Manifest(1, "resources", "i", checkpoint_id, "records-0.jsonl", "0", 0)
    return CommitAnswer("committed", manifest, [])


def test_restarts_are_named_by_participant_rollout_and_attempt():
    result = prepared({"http://env": ["3-0", "r9-a1"], "http://agent": ["3-0"], "http://m": []})
    assert result.restarts_by_participant() == {
        "http://env": {EpisodeId("3-0", 0), EpisodeId("r9", 1)},
        "http://agent": {EpisodeId("3-0", 0)},
        "http://m": set(),
    }
    committed = {url: commit_answer() for url in result.replies}
    outcome = CheckpointResult.of("ck3", committed, result.restarts_by_participant())
    assert not outcome.complete
    assert outcome.restart_episodes() == (EpisodeId("3-0", 0), EpisodeId("r9", 1))  # once each
    document = outcome.as_json()
    assert document["complete"] is False and document["restart_count"] == 2
    assert document["restarts"] == {
        "http://agent": [{"rollout_id": "3-0", "attempt": 0}],
        "http://env": [{"rollout_id": "3-0", "attempt": 0}, {"rollout_id": "r9", "attempt": 1}],
        "http://m": [],
    }
    assert document["committed"] == {url: a.as_json() for url, a in committed.items()}
    assert document["retired"] == []
    assert "partial: 2 rollout(s) in flight are not in it" in document["summary"]
    assert "http://env (2), http://agent (1)" not in document["summary"]  # sorted by URL
    assert "http://agent (1), http://env (2)" in document["summary"]
    assert exit_status(outcome, allow_restarts=False) == CHECKPOINT_PARTIAL
    assert exit_status(outcome, allow_restarts=True) == 0


def test_a_checkpoint_without_restarts_is_complete():
    outcome = CheckpointResult.of("ck", {"http://a": commit_answer("ck")}, {"http://a": set()})
    assert outcome.complete and outcome.as_json()["summary"].endswith("; complete")
    assert exit_status(outcome, allow_restarts=False) == 0
    assert exit_status({"resumed": "ck"}, allow_restarts=False) == 0  # other commands


def test_retired_stragglers_make_it_partial_too():
    outcome = CheckpointResult.of("ck.r", {}, {"http://a": set()}, [EpisodeId("s", 2)])
    assert not outcome.complete
    assert outcome.as_json()["retired"] == [{"rollout_id": "s", "attempt": 2}]
    assert "1 straggler(s) were retired" in outcome.summary()


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("localhost:8000/", "http://localhost:8000"),
        ("http://h:1", "http://h:1"),
        ("https://h/gym/", "https://h/gym"),
    ],
)
def test_server_urls_without_a_scheme_are_http(text, url):
    assert _server(text) == url


@pytest.mark.parametrize(
    ("text", "why"),
    [("ftp://h:1", "http:// or https://"), ("http://h:x", "port"), ("http://:80", "no host")],
)
def test_bad_server_urls_say_why(text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        _server(text)


def test_help_is_whole_and_names_the_token_variable_and_exit_statuses():
    parser = _parser()
    text = parser.format_help()
    assert "GYM_PROXY_CONTROL_TOKEN" in text
    assert parser.description is not None and parser.description.endswith("on stderr.")
    assert "  3  checkpoint committed but partial" in text
    assert parser._subparsers is not None
    subcommands = parser._subparsers._group_actions[0]
    assert isinstance(subcommands, argparse._SubParsersAction)
    helps = {action.dest: action.help for action in subcommands._choices_actions}
    assert set(helps) == set(subcommands.choices) and all(helps.values()), helps
    assert "--allow-restarts" in subcommands.choices["checkpoint"].format_help()


class FakeParticipant:
    """A participant's control plane in process: canned prepare replies by checkpoint ID,
    every call recorded."""

    def __init__(self, prepare: dict[str, dict[str, Any]]) -> None:
        self.prepare = prepare
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/ng-control/v1/checkpoint/{op}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        """Each call answered in NeMo Gym's Gen-2 shape (and one key of its own more,
        which a controller leaves out)."""
        op = request.match_info["op"]
        body = await request.json() if request.method == "POST" else {}
        self.calls.append((op, body))
        answer: Any = {"phase": "idle", "idempotent": False}
        if op == "status":
            closed = report("idle", [], [])["report"]
            answer = {"kind": "agent", "instance": "a", "phase": "idle", "checkpoint_id": None}
            answer |= {"lease_expires_at": None, "retired_rollouts": 0, "report": closed}
        if op == "prepare":
            answer = self.prepare[body["checkpoint_id"]]
        if op == "commit":
            manifest = commit_answer(body["checkpoint_id"]).manifest.as_json()
            answer = {"phase": "committed", "manifest": manifest, "episode_ids": []}
        if op == "retire":
            answer = {
                "retired": [f"{e['rollout_id']}-a{e['attempt']}" for e in body["episode_ids"]]
            }
        return web.json_response({**answer, "staging_keys": []})


def report(phase: str, blockers: list[str], restarts: list[str]) -> dict[str, Any]:
    counts = {"in_flight": len(blockers)}
    ready = {"ready": phase == "prepared", "blockers": blockers, "blocker_count": len(blockers)}
    return {"phase": phase, "report": {**ready, "counts": counts, "restarts": restarts}}


async def test_checkpoint_result_carries_the_restarts_and_the_retired(aiohttp_server):
    fake = FakeParticipant(
        {
            "ck": report("preparing", ["slow-a2"], ["x"]),
            "ck.r": report("prepared", [], ["r1", "r2-a3"]),
        }
    )
    server = await aiohttp_server(fake.app())
    url = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as http:
        controller = Controller([Participant(url, "t", http)], timeout=10)
        await controller.learn_kinds()
        outcome = await controller.checkpoint("ck", "/d", stragglers="retire", keep_open=True)
    assert outcome.checkpoint_id == "ck.r"
    assert outcome.restarts == {url: (EpisodeId("r1", 0), EpisodeId("r2", 3))}
    assert outcome.retired == (EpisodeId("slow", 2),) and not outcome.complete
    ops = [op for op, _ in fake.calls]
    # resumed before the retire, never after the commit (kept open)
    assert ops == ["status", "prepare", "resume", "retire", "prepare", "commit"], ops


@pytest.mark.parametrize("body", [b"", b"[]", b"null"])
async def test_a_200_reply_that_is_not_an_object_is_a_control_failure(aiohttp_server, body):
    """Callers read a reply's keys: one without keys is the participant's failure, a
    ControlFailed that gym-proxy-ctl reports, not a TypeError in whichever caller reads it."""

    async def status(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/ng-control/v1/checkpoint/status", status)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as http:
        with pytest.raises(ControlFailed) as failed:
            await Participant(url, "t", http).learn_kind()
    assert failed.value.codes == {"invalid_reply"}
    assert "not a JSON object" in str(failed.value)


def test_a_session_id_that_begins_with_a_dash_is_given_with_equals():
    """IDs not minted by gym-proxy may begin with '-': `--session=ID` carries them."""
    args = _parser().parse_args(
        ["--server", "http://h:1", "move", "--session=-x1", "--to-slot", "1"]
    )
    assert args.session == ["-x1"]

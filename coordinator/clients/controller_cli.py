"""`gym-proxy-ctl`: checkpoint, restore, resume, retire and forget across one or more
participants (gym-proxy or NeMo Gym servers); move sessions, drain, restart and resize
the workers of one gym-proxy.

    gym-proxy-ctl --server 127.0.0.1:8000 status
    gym-proxy-ctl --server URL1 --server URL2 checkpoint ck1 /ckpt/step-10 [--stop]
    gym-proxy-ctl --server URL restore r1 /ckpt/step-10 --episode r7:0 --resume
    gym-proxy-ctl --server URL retire x1 --episode r7:1
    gym-proxy-ctl --server URL forget x2 --rollout r7
    gym-proxy-ctl --server URL move --session ID --to-slot 1
    gym-proxy-ctl --server URL drain 0 | undrain 0 | restart [--slot 2] | resize 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from gym_proxy.coordinator.clients.checkpoint_result import CheckpointResult
from gym_proxy.coordinator.clients.controller import ControlFailed, Controller, Participant
from gym_proxy.coordinator.contract.episodes import EpisodeId
from gym_proxy.coordinator.contract.exit_codes import CHECKPOINT_PARTIAL, FAILED, USAGE_ERROR

__all__ = ["main"]

DESCRIPTION = """\
Drive the checkpoint control plane (NeMo Gym's Gen-2, /ng-control/v1/checkpoint) of one or
more participants, gym-proxy or NeMo Gym servers, in NeMo Gym's order; run live operations
(move, drain, undrain, restart, resize) on one gym-proxy. Replies are printed as JSON on
stdout; a refused call prints one line on stderr."""

EPILOG = """\
examples:
  gym-proxy-ctl --server 127.0.0.1:8000 status
  gym-proxy-ctl --server http://env:8000 --server http://res:8001 checkpoint ck1 /ckpt/10
  gym-proxy-ctl --server URL restore r1 /ckpt/10 --episode rollout-7:0 --resume

checkpoint output: {checkpoint_id, complete, summary, restart_count, restarts: {URL:
[{rollout_id, attempt}]}, retired: [...], committed: {URL: commit reply}}. Restarts are
rollouts in flight that a participant cannot capture (a restart-only server's): the
checkpoint holds nothing of them, so after a restore they must start over from their input.

exit statuses:
  0  done; a checkpoint holds every rollout in flight (or --allow-restarts was given)
  1  a participant refused a call or could not be reached, or a prepare was not ready
     by --timeout (everything was resumed)
  2  bad usage: an unknown flag, no token, a --server that is not an http(s) URL
  3  checkpoint committed but partial: rollouts named in "restarts" (or stragglers
     in "retired") are not in it and must be started over; the output lists them"""


def _episode(text: str) -> EpisodeId:
    rollout_id, _, attempt = text.rpartition(":")
    if not rollout_id or not attempt.isdigit():
        raise argparse.ArgumentTypeError(f"episode must be ROLLOUT_ID:ATTEMPT, got {text!r}")
    return EpisodeId(rollout_id, int(attempt))


def _server(text: str) -> str:
    """A participant's base URL. gym-proxy serves plain HTTP, so `host:port` (no scheme)
    means `http://host:port`; any other scheme is refused rather than guessed at."""
    url = text if "://" in text else f"http://{text}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(f"{text!r}: the scheme must be http:// or https://")
    try:
        _ = parts.port  # raises ValueError on a port that is not 0-65535
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the port must be 0-65535") from None
    if not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} names no host (expected HOST:PORT)")
    return url.rstrip("/")


OPERATIONS = ("drain", "undrain", "restart", "resize")
CHECKPOINT_ID_HELP = "a checkpoint ID: 1-128 of A-Z a-z 0-9 . _ - (not starting . _ -)"


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, text: str
) -> argparse.ArgumentParser:
    """A subcommand whose one-line help is also the description its own --help shows."""
    return commands.add_parser(name, help=text, description=text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gym-proxy-ctl",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--server",
        type=_server,
        action="append",
        required=True,
        metavar="URL",
        help="a participant's URL (repeat for several); HOST:PORT means http://HOST:PORT",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("GYM_PROXY_CONTROL_TOKEN"),
        help="the participants' control token (default: $GYM_PROXY_CONTROL_TOKEN)",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per operation (default: 300)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _command(commands, "status", "each participant's checkpoint status")
    _checkpoint_commands(commands)
    resume = _command(commands, "resume", "resume (or abort) a checkpoint everywhere")
    resume.add_argument("checkpoint_id", help=CHECKPOINT_ID_HELP)
    retire = _command(
        commands, "retire", "stop attempts everywhere and free their state (callers first)"
    )
    retire.add_argument("checkpoint_id", help=CHECKPOINT_ID_HELP)
    retire.add_argument(
        "--episode",
        type=_episode,
        action="append",
        required=True,
        metavar="ROLLOUT_ID:ATTEMPT",
        help="an attempt to retire",
    )
    forget = _command(
        commands, "forget", "stop refusing the retired attempts of rollouts (callers first)"
    )
    forget.add_argument("checkpoint_id", help=CHECKPOINT_ID_HELP)
    forget.add_argument("--rollout", action="append", required=True, help="a rollout ID")
    move = _command(
        commands, "move", "move live sessions of one gym-proxy (--server) to another worker"
    )
    move.add_argument(
        "--session",
        action="append",
        required=True,
        help="a session ID (one that begins with '-' as --session=ID)",
    )
    move.add_argument("--to-slot", type=int, required=True, help="the worker slot to move to")
    for name, help_text in (
        ("drain", "no new sessions on a worker; move its sessions to the others"),
        ("undrain", "a drained worker takes new sessions again"),
        ("restart", "rolling restart: replace each worker (or --slot ones), sessions moved"),
        ("resize", "grow or shrink to N workers while serving"),
    ):
        operation = _command(commands, name, help_text)
        if name in ("drain", "undrain"):
            operation.add_argument("slot", type=int, help="the worker slot")
        elif name == "restart":
            operation.add_argument(
                "--slot", type=int, action="append", dest="slots", help="a slot to restart"
            )
            operation.add_argument("--pause", type=float, help="seconds between slots")
        else:
            operation.add_argument("workers", type=int, help="the worker count wanted")
    return parser


def _checkpoint_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for name, help_text in (
        (
            "checkpoint",
            "prepare (callers first), commit everywhere, resume (callees first); exit 3 "
            "if rollouts in flight are not in the checkpoint (see exit statuses)",
        ),
        ("restore", "restore everywhere at once, or nowhere (on freshly started servers)"),
    ):
        command = _command(commands, name, help_text)
        command.add_argument("checkpoint_id", help=CHECKPOINT_ID_HELP)
        command.add_argument("checkpoint_dir", help="a directory on the participants' hosts")
        command.add_argument(
            "--episode",
            type=_episode,
            action="append",
            default=None,
            metavar="ROLLOUT_ID:ATTEMPT",
            help="the scope (checkpoint: episodes to continue; "
            "restore: source attempts, continued as ATTEMPT+1)",
        )
    checkpoint = commands.choices["checkpoint"]
    checkpoint.add_argument("--keep-open", action="store_true", help="do not resume after commit")
    checkpoint.add_argument(
        "--stop", action="store_true", help="commit with stop: servers free what they can"
    )
    checkpoint.add_argument(
        "--stragglers",
        choices=("fail", "retire"),
        default="fail",
        help="a prepare not ready by --timeout: fail, or retire its blocking episodes and "
        "prepare again (as CHECKPOINT_ID.r)",
    )
    checkpoint.add_argument(
        "--allow-restarts",
        action="store_true",
        help=f"exit 0, not {CHECKPOINT_PARTIAL}, when the checkpoint is partial (restarts or "
        "retired stragglers); they are printed either way",
    )
    commands.choices["restore"].add_argument(
        "--resume", action="store_true", help="resume right after the restore"
    )


def _only_one(args: argparse.Namespace) -> str:
    if len(args.server) != 1:
        raise ControlFailed(args.command, {"--server": (0, "invalid_request", "name one")})
    return str(args.server[0])


async def _run(args: argparse.Namespace) -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        controller = Controller(
            [Participant(url, args.token, http) for url in args.server], timeout=args.timeout
        )
        if args.command == "status":
            return [status.as_json() for status in await controller.status()]
        if args.command == "resume":
            await controller.resume(args.checkpoint_id)
            return {"resumed": args.checkpoint_id}
        if args.command == "move":
            participant = Participant(_only_one(args), args.token, http)
            moved = await participant.move_sessions(args.session, args.to_slot, args.timeout)
            return moved.as_json()
        if args.command in OPERATIONS:
            participant = Participant(_only_one(args), args.token, http)
            return (await participant.operate(args.command, _operation_body(args))).as_json()
        await controller.learn_kinds()
        if args.command == "checkpoint":
            return await controller.checkpoint(
                args.checkpoint_id,
                args.checkpoint_dir,
                args.episode,
                stop=args.stop,
                stragglers=args.stragglers,
                keep_open=args.keep_open,
            )
        if args.command == "restore":
            replies = await controller.restore(
                args.checkpoint_id, args.checkpoint_dir, args.episode or []
            )
            if args.resume:
                await controller.resume(args.checkpoint_id)
            return {url: answer.as_json() for url, answer in replies.items()}
        if args.command == "forget":
            await controller.forget(args.checkpoint_id, args.rollout)
            return {"forgotten": sorted(set(args.rollout))}
        await controller.retire(args.checkpoint_id, args.episode)
        return {"retired": [e.key for e in args.episode]}


def _operation_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if args.command in ("drain", "undrain"):
        body["slot"] = args.slot
    if args.command == "resize":
        body["workers"] = args.workers
    if args.command == "restart" and args.slots:
        body["slots"] = args.slots
    if args.command == "restart" and args.pause is not None:
        body["pause_s"] = args.pause
    if args.command != "undrain":
        body["timeout_s"] = min(args.timeout, 3600.0)
    return body


def exit_status(result: object, allow_restarts: bool) -> int:
    """0, or CHECKPOINT_PARTIAL for a partial checkpoint unless restarts are allowed."""
    partial = isinstance(result, CheckpointResult) and not result.complete
    return CHECKPOINT_PARTIAL if partial and not allow_restarts else 0


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point (exit statuses: the --help epilog)."""
    args = _parser().parse_args(argv)
    if not args.token:
        print(
            "gym-proxy-ctl: error: --token or GYM_PROXY_CONTROL_TOKEN is required", file=sys.stderr
        )
        sys.exit(USAGE_ERROR)
    try:
        result = asyncio.run(_run(args))
    except ControlFailed as exc:
        print(f"gym-proxy-ctl: {exc}", file=sys.stderr)
        sys.exit(FAILED)
    document = result.as_json() if isinstance(result, CheckpointResult) else result
    sys.stdout.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
    status = exit_status(result, getattr(args, "allow_restarts", False))
    if isinstance(result, CheckpointResult) and not result.complete:
        # stdout stays one JSON document; the warning a person must not miss goes here.
        advice = "accepted (--allow-restarts)" if status == 0 else "--allow-restarts accepts it"
        print(f"gym-proxy-ctl: {result.summary()}; {advice}", file=sys.stderr)
    if status:
        sys.exit(status)

"""`gym-proxy-ctl`: checkpoint, restore, resume and retire one or more participants;
move sessions, drain, restart and resize the workers of one gym-proxy.

    gym-proxy-ctl --server http://127.0.0.1:8000 status
    gym-proxy-ctl --server URL1 --server URL2 checkpoint ck1 /ckpt/step-10 [--stop]
    gym-proxy-ctl --server URL restore r1 /ckpt/step-10 --episode r7:0 --resume
    gym-proxy-ctl --server URL retire x1 --episode r7:1
    gym-proxy-ctl --server URL forget x2 --rollout r7
    gym-proxy-ctl --server URL move --session ID --to-slot 1
    gym-proxy-ctl --server URL drain 0 | undrain 0 | restart [--slot 2] | resize 4

The token comes from `--token` or GYM_PROXY_CONTROL_TOKEN. Replies are printed as JSON;
a refused call prints one line on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson

from coordinator.clients.controller import ControlFailed, Controller, Participant
from coordinator.contract.episodes import EpisodeId

__all__ = ["main"]


def _episode(text: str) -> EpisodeId:
    rollout_id, _, attempt = text.rpartition(":")
    if not rollout_id or not attempt.isdigit():
        raise argparse.ArgumentTypeError(f"episode must be ROLLOUT_ID:ATTEMPT, got {text!r}")
    return EpisodeId(rollout_id, int(attempt))


OPERATIONS = ("drain", "undrain", "restart", "resize")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gym-proxy-ctl", description=__doc__.splitlines()[0])
    parser.add_argument("--server", action="append", required=True, help="participant URL")
    parser.add_argument("--token", default=os.environ.get("GYM_PROXY_CONTROL_TOKEN"))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per operation")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("status")
    for name in ("checkpoint", "restore"):
        command = commands.add_parser(name)
        command.add_argument("checkpoint_id")
        command.add_argument("checkpoint_dir")
        command.add_argument("--episode", type=_episode, action="append", default=None)
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
    commands.choices["restore"].add_argument(
        "--resume", action="store_true", help="resume right after the restore"
    )
    commands.add_parser("resume").add_argument("checkpoint_id")
    retire = commands.add_parser("retire")
    retire.add_argument("checkpoint_id")
    retire.add_argument("--episode", type=_episode, action="append", required=True)
    move = commands.add_parser(
        "move", help="move live sessions of one gym-proxy (--server) to another worker"
    )
    move.add_argument("--session", action="append", required=True, help="a session ID")
    move.add_argument("--to-slot", type=int, required=True, help="the worker slot to move to")
    for name, help_text in (
        ("drain", "no new sessions on a worker; move its sessions to the others"),
        ("undrain", "a drained worker takes new sessions again"),
        ("restart", "rolling restart: replace each worker (or --slot ones), sessions moved"),
        ("resize", "grow or shrink to N workers while serving"),
    ):
        operation = commands.add_parser(name, help=help_text)
        if name in ("drain", "undrain"):
            operation.add_argument("slot", type=int)
        elif name == "restart":
            operation.add_argument("--slot", type=int, action="append", dest="slots")
            operation.add_argument("--pause", type=float, help="seconds between slots")
        else:
            operation.add_argument("workers", type=int)
    forget = commands.add_parser("forget")
    forget.add_argument("checkpoint_id")
    forget.add_argument("--rollout", action="append", required=True)
    return parser


async def _run(args: argparse.Namespace) -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        controller = Controller(
            [Participant(url, args.token, http) for url in args.server], timeout=args.timeout
        )
        if args.command == "status":
            return await controller.status()
        if args.command == "resume":
            await controller.resume(args.checkpoint_id)
            return {"resumed": args.checkpoint_id}
        if args.command == "move":
            if len(args.server) != 1:
                raise ControlFailed("move", {"--server": (0, "invalid_request", "name one")})
            participant = Participant(args.server[0], args.token, http)
            return await participant.move_sessions(args.session, args.to_slot, args.timeout)
        if args.command in OPERATIONS:
            if len(args.server) != 1:
                raise ControlFailed(args.command, {"--server": (0, "invalid_request", "name one")})
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
            participant = Participant(args.server[0], args.token, http)
            return await participant.operate(args.command, body)
        await controller.learn_kinds()
        if args.command == "checkpoint":
            if args.keep_open:
                result = await controller.prepare(args.checkpoint_id)
                if not result.prepared:
                    await controller.resume(args.checkpoint_id)
                    raise ControlFailed("prepare", {"not ready": (409, "not_ready", "")})
                return await controller.commit(
                    args.checkpoint_id, args.checkpoint_dir, args.episode, args.stop
                )
            return await controller.checkpoint(
                args.checkpoint_id,
                args.checkpoint_dir,
                args.episode,
                stop=args.stop,
                stragglers=args.stragglers,
            )
        if args.command == "restore":
            replies = await controller.restore(
                args.checkpoint_id, args.checkpoint_dir, args.episode or []
            )
            if args.resume:
                await controller.resume(args.checkpoint_id)
            return replies
        if args.command == "forget":
            await controller.forget(args.checkpoint_id, args.rollout)
            return {"forgotten": sorted(set(args.rollout))}
        await controller.retire(args.checkpoint_id, args.episode)
        return {"retired": [e.key for e in args.episode]}


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point."""
    args = _parser().parse_args(argv)
    if not args.token:
        print(
            "gym-proxy-ctl: error: --token or GYM_PROXY_CONTROL_TOKEN is required", file=sys.stderr
        )
        sys.exit(2)
    try:
        result = asyncio.run(_run(args))
    except ControlFailed as exc:
        print(f"gym-proxy-ctl: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.stdout.write(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode() + "\n")

"""The command-line reference, rendered from `Config` (as gunicorn renders its settings).

`docs/cli.md` holds the flag table between two marker lines; everything in it comes from
the fields of `proxy.config.Config` (their `doc`, `doc_default`, `env` and `metavar`
metadata) and from the parser's own `--version` and `--help`. Nothing is written twice:
change a flag in `proxy/config.py`, then run

    python -m gym_proxy.proxy.cli_reference          # rewrite the table in docs/cli.md
    python -m gym_proxy.proxy.cli_reference --check  # exit 1 if docs/cli.md is stale

`tests/test_docs.py` fails while the file is stale.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import Field, fields
from pathlib import Path
from typing import Any

from gym_proxy.proxy.config import Config, build_parser

__all__ = ["BEGIN", "END", "CLI_DOC", "render_table", "render_document", "main"]

BEGIN = "<!-- BEGIN cli-reference: generated from proxy/config.py by `python -m gym_proxy.proxy.cli_reference`; do not edit -->"  # noqa: E501
END = "<!-- END cli-reference -->"
CLI_DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def _cell(text: str) -> str:
    """A Markdown table cell: one line, no unescaped pipe."""
    return " ".join(text.split()).replace("|", "\\|")


def _flag(item: Field[Any]) -> str:
    meta = item.metadata
    if meta["positional"]:
        return f"`{meta['metavar']}`"
    name = "--" + item.name.replace("_", "-")
    if meta["flag"] or not meta["metavar"]:
        return f"`{name}`"
    return f"`{name} {meta['metavar']}`"


def _number(value: float) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _default(item: Field[Any]) -> str:
    meta = item.metadata
    text: str
    if meta["doc_default"] is not None:
        text = meta["doc_default"]
    elif meta["flag"]:
        text = "off"
    elif item.default is None:
        text = ""
    elif isinstance(item.default, str):
        text = f"`{item.default}`"
    else:
        assert isinstance(item.default, int | float), item.name
        text = _number(item.default)
    if meta["env"]:
        text = f"{text} (env `{meta['env']}`)".strip()
    return text


def _rows() -> list[tuple[str, str, str]]:
    rows = []
    for item in fields(Config):
        meta = item.metadata
        if meta.get("internal"):
            continue
        rows.append((_flag(item), _default(item), meta["doc"] or meta["help"]))
    # What the parser adds beside Config's fields: --version and --help.
    for action in build_parser()._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            flags = ", ".join(f"`{s}`" for s in action.option_strings)
            rows.append((flags, "", action.help or ""))
    return rows


def render_table() -> str:
    """The flag table, one row per option, in Config's field order."""
    lines = ["| flag | default | meaning |", "|---|---|---|"]
    for flag, default, meaning in _rows():
        lines.append(f"| {_cell(flag)} | {_cell(default)} | {_cell(meaning)} |")
    return "\n".join(lines)


def render_document(text: str) -> str:
    """`text` (docs/cli.md) with the part between the markers replaced by the table."""
    head, begin, rest = text.partition(BEGIN + "\n")
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{CLI_DOC} lacks the markers {BEGIN!r} ... {END!r}")
    return f"{head}{BEGIN}\n{render_table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gym_proxy.proxy.cli_reference", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md is stale")
    args = parser.parse_args(argv)
    current = CLI_DOC.read_text(encoding="utf-8")
    wanted = render_document(current)
    if args.check:
        if wanted != current:
            print(
                f"{CLI_DOC} is stale: run python -m gym_proxy.proxy.cli_reference", file=sys.stderr
            )
            return 1
        return 0
    if wanted != current:
        CLI_DOC.write_text(wanted, encoding="utf-8")
        print(f"wrote {CLI_DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

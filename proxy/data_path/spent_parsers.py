"""What a closed connection's parser is replaced by.

A connection's own llhttp parser refers back to it (its callbacks are the connection's
methods): a cycle only the garbage collector would free, with a collection every few
hundred closed connections that costs more than the rest of a close. Replacing the
parser when the connection is lost lets both go as soon as nothing else holds them.
These parsers call nothing: nothing is fed to them.
"""

from __future__ import annotations

from typing import Final

import httptools

__all__ = ["SPENT_REQUEST_PARSER", "SPENT_RESPONSE_PARSER"]


class _Nobody:
    """The callbacks of a parser no connection reads with any more: none."""


SPENT_REQUEST_PARSER: Final = httptools.HttpRequestParser(_Nobody())
SPENT_RESPONSE_PARSER: Final = httptools.HttpResponseParser(_Nobody())

"""`gym-proxy --help` in sections (proxy/config.py's HELP_GROUPS): every option in
exactly one, so none is left out of the parser (it would not be read at all)."""

from __future__ import annotations

from collections import Counter
from dataclasses import fields

import pytest

from gym_proxy.proxy.config import HELP_GROUPS, Config, build_parser

pytestmark = pytest.mark.fast


def test_every_option_is_in_exactly_one_help_section():
    options = [item.name for item in fields(Config) if not item.metadata.get("internal")]
    placed = Counter(name for _, names in HELP_GROUPS for name in names)
    assert sorted(placed) == sorted(options)
    assert [name for name, times in placed.items() if times > 1] == []


def test_help_shows_the_sections_in_order_and_a_short_usage():
    text = build_parser().format_help()
    assert text.startswith("usage: gym-proxy [OPTIONS] [APP]\n")
    at = [text.index(f"\n{title}:\n") for title, _ in HELP_GROUPS]
    assert at == sorted(at)

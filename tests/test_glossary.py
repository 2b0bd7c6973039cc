"""One verb per act (docs/design.md, "Words"): the glossary names each act once, and a
word it retired does not come back, in the code, its comments, the tests or the docs.

The retired words are patterns of the uses the glossary replaced, not every use of the
word: "adopt" stays for workers a gym-proxy takes over, "retire" for NeMo Gym's rollout
attempts, "hand over" for running episodes. bench/HISTORY.md and bench/results/ are
history, and keep the words of their day.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import REPO

pytestmark = pytest.mark.fast

GLOSSARY = REPO / "docs" / "design.md"
# (pattern, the word that replaced it)
RETIRED: tuple[tuple[str, str], ...] = (
    (r"(?-i:\bclass Adopt\b|\bAdopt\()|[\"`]adopt[\"`]", "move_in (a move's target installs)"),
    (
        r"\badopt\w*[ _](the |its |their |these )?(sessions?|records?|episodes?)\b",
        "install / receive",
    ),
    (
        r"\badopt_episodes\b|\bADOPT_WAIT\b|before-adopt|move-adopted|worker-adopted",
        "receive / install",
    ),
    (r"\bhand\w*[ -]over (the |its |their |all )?workers\b", "pass on"),
    (r"\bworkers (were |are |is )?handed over\b|handing-over instance", "pass on"),
    (r"\b(Server|supervisor)\.hand_over\b", "pass_on"),
    (r"\bworker_retire\b|\bRETRY_RETIRE\b", "decommission"),
    (r"\bretir\w* (a |the |its |their |one |each |old )*(old )?workers?\b", "decommission"),
    (r"\bworkers? (is |are |was |were |being )?retired\b|\bretiring worker", "decommission"),
    (r"\bTUNNELING\b", "TUNNEL"),
    (r"\bworker[./]participation\b", "worker.declaration"),
    # The gate is the placed worker's link (`worker.link_gate`); admission is the door.
    (r"\b(close|open)_gate\b|\b(its|the|worker's) gates? (is |are )?(closed|reopened)", "door"),
    # The new gym-proxy takes over; the running one passes on.
    (r"(?-i:\btakeover\b|\bTAKEOVER_|\bself\.taken\b|\b_taken\b)", "take_over / pass_on"),
    (r"\bretired when it can be\b", "decommissioned when it can be"),
    # A restore assigns sessions; Ray places workers; a rebalance moves sessions by load.
    (r"\bplaced_(app_)?sessions\b|\bcoordinator[./]placement\b", "assign (assigned_sessions)"),
    (r"\bplacement that follows load\b", "rebalance"),
)
VERBS = (
    "move", "install", "hand over", "receive", "drain", "decommission", "recycle",
    "pass on", "take over", "adopt", "retire", "release", "drop", "tunnel", "place", "assign",
    "link", "rebalance", "autoscale",
)  # fmt: skip


def scanned() -> list[Path]:
    files = [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "bench" / "README.md"]
    for folder in ("proxy", "worker", "coordinator", "docs", "tests"):
        files += [p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".md")]
    files += (REPO / "bench").glob("*.py")
    return [f for f in files if f != Path(__file__)]


RENAMES = "Before the first release these names changed"  # the glossary's one mention


def without_the_renames(text: str) -> str:
    """The text, its paragraph that lists the old names blanked (lines kept)."""
    start = text.find(RENAMES)
    if start < 0:
        return text
    end = text.find("\n\n", start)
    return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


def test_no_retired_word_comes_back():
    found = []
    for path in scanned():
        text = without_the_renames(path.read_text())
        for pattern, instead in RETIRED:
            for match in re.finditer(pattern, text, re.I):
                line = text.count("\n", 0, match.start()) + 1
                where = path.relative_to(REPO)
                found.append(f"{where}:{line}: {match.group(0)!r}: say {instead}")
    assert not found, "\n".join(found)


def test_the_glossary_names_every_act_once():
    text = GLOSSARY.read_text()
    section = text.split("\n## Words\n", 1)[1].split("\n## ", 1)[0]
    defined = re.findall(r"^\| \*\*([a-z ]+)\*\* \|", section, re.M)
    assert sorted(defined) == sorted(VERBS)


def test_the_check_sees_a_retired_word():
    samples = [
        "the target adopts the sessions",
        "4 workers handed over",
        "retires the old worker",
        "TUNNELING",
        'exclusive("worker_retire", ...)',
        "runtime.close_gate(cid)",
        "every worker's gate closed",
        "self.takeover = None",
        "self._taken = x",
        "left serving; retired when it can be",
        'manifest["placed_sessions"]',
        "Placement that follows load",
    ]
    for sample in samples:
        assert any(re.search(p, sample, re.I) for p, _ in RETIRED), sample
    for kept in (
        "adopts the workers a dead instance left",
        "retire an attempt",
        "hand over episodes",
        "behind its gate (worker.link_gate)",
        "taken over by a new gym-proxy",
        "take-over.sock",
    ):
        assert not any(re.search(p, kept, re.I) for p, _ in RETIRED), kept

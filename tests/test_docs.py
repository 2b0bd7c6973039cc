"""The documentation cannot go stale silently: the CLI table is regenerated from `Config`
and compared, the mkdocs site builds with `--strict` (no broken link or anchor, no page
left out of the nav), every repository path the docs name exists, the links of the pages
outside the site (README.md, CONTRIBUTING.md, bench/README.md) resolve, and the README's
drawing of the processes is the design page's. The dotted names the docs give our code
(`proxy.fleet.moves.mover`, `Router.route_request`) are resolved in the fast tier:
tests/test_doc_names.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from gym_proxy.proxy.cli_reference import CLI_DOC, main, render_document, render_table
from gym_proxy.proxy.config import build_parser

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
# Pages that GitHub renders but the mkdocs site does not hold (mkdocs checks its own links).
OUTSIDE_SITE = [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "bench" / "README.md"]
PAGES = sorted(DOCS.glob("*.md")) + OUTSIDE_SITE

# Paths the docs name that only a compiled install makes (setup.py's mypyc build): checked
# where one was made, as the suite's is (a whitelist of them hid the old, moved ones).
BUILD_OUTPUTS = {
    "proxy/data_path/*.<abi>.so",
    "proxy/data_path/_compiled_sources.<abi>.json",
}
OTHER_REPOSITORIES = ("nemo_gym/", "nemo_rl/", "examples/nemo_gym/")  # NeMo Gym's, NeMo-RL's

FENCE = re.compile(r"^ *```.*?^ *```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
# A path inside this repository: one of its top-level directories, then anything path-like.
REPO_PATH = re.compile(
    r"(?<![\w./~$<>-])((?:\.ci|bench|coordinator|docs|proxy|tests|worker)/[\w.*<>/-]*)"
)
# Any other relative path to a file: it must be this repository's, or be listed above.
FILE_PATH = re.compile(
    r"(?<![\w./~$<>-])([\w.-]+/[\w.*<>/-]*\.(?:py|md|json|jsonl|yaml|yml|toml|sh|txt))\b"
)
ROOT_FILES = ("README.md", "CONTRIBUTING.md", "mkdocs.yml", "pyproject.toml", "setup.py")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _code(text: str) -> list[str]:
    """The fenced blocks and inline code spans of a Markdown page."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    return blocks + [m.group(1) for m in SPAN.finditer(FENCE.sub("", text))]


def _exists(path: str) -> bool:
    pattern = re.sub(r"<[^>]*>", "*", path.rstrip("."))
    if "*" in pattern:
        return any(REPO.glob(pattern))
    return (REPO / pattern).exists()


def _named_paths(page: Path) -> set[str]:
    named: set[str] = set()
    for code in _code(page.read_text(encoding="utf-8")):
        named.update(m.group(1) for m in REPO_PATH.finditer(code))
        named.update(
            m.group(1)
            for m in FILE_PATH.finditer(code)
            if not m.group(1).startswith(OTHER_REPOSITORIES)
        )
        named.update(f for f in ROOT_FILES if f"`{f}`" in f"`{code}`")
    return named


def slug(heading: str) -> str:
    """A heading's anchor, as Python-Markdown's toc (mkdocs) and GitHub make it."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} +(.+?) *$", text, re.M)}


# --- the CLI reference ------------------------------------------------------------------


def test_cli_reference_is_current():
    current = CLI_DOC.read_text(encoding="utf-8")
    assert render_document(current) == current, (
        "docs/cli.md's flag table is stale: run python -m gym_proxy.proxy.cli_reference"
    )
    assert main(["--check"]) == 0


def test_cli_reference_has_every_option():
    table = render_table()
    for action in build_parser()._actions:
        for option in action.option_strings:
            assert f"`{option}" in table, option
    assert "`APP`" in table
    # one row per option, each with three cells
    rows = [line for line in table.splitlines()[2:]]
    assert all(row.count(" | ") == 2 for row in rows), rows


def test_render_document_needs_the_markers():
    with pytest.raises(ValueError):
        render_document("# Command line\n\nno markers here\n")


# --- the site ---------------------------------------------------------------------------


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_site_builds_strict(tmp_path):
    result = _mkdocs_build(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_site_build_fails_on_a_broken_anchor(tmp_path):
    """The strictness is real: mkdocs.yml turns a link to a missing anchor into a failure."""
    shutil.copytree(DOCS, tmp_path / "docs")
    with (tmp_path / "docs" / "index.md").open("a", encoding="utf-8") as page:
        page.write("\n[broken](cli.md#no-such-anchor)\n")
    config = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    (tmp_path / "mkdocs.yml").write_text(config, encoding="utf-8")
    result = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-anchor" in result.stdout + result.stderr


# --- paths and links --------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_named_paths_exist(page):
    built = any((REPO / "proxy" / "data_path").glob("_compiled_sources.*.json"))
    unbuilt = set() if built else BUILD_OUTPUTS
    missing = sorted(p for p in _named_paths(page) - unbuilt if not _exists(p))
    assert not missing, f"{page.relative_to(REPO)} names paths that do not exist: {missing}"


def test_path_scan_finds_paths():
    """The scan itself: what it must find, and what it must leave alone."""
    page = (
        "see `proxy/data_path/routing.py` and `tests/test_nemo_gym_*.py`, `/run/gym-secret`,\n"
        "`nemo_gym/_checkpoint/control.py`, `setup.py`\n\n"
        "```sh\n.venv/bin/python bench/moves.py   # comment\n```\n"
    )
    named: set[str] = set()
    for code in _code(page):
        named.update(m.group(1) for m in REPO_PATH.finditer(code))
    assert named == {"proxy/data_path/routing.py", "tests/test_nemo_gym_*.py", "bench/moves.py"}
    assert all(_exists(p) for p in named)
    assert not _exists("proxy/no_such_module.py")


@pytest.mark.parametrize("page", OUTSIDE_SITE, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: broken links {broken}"


# --- the front page ---------------------------------------------------------------------


def test_readme_is_a_front_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    linked = {
        (REPO / target.partition("#")[0]).resolve()
        for target in LINK.findall(readme)
        if not re.match(r"[a-z]+:", target)
    }
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"README.md's table of contents lacks {unlinked}"


def test_readme_runs_what_ci_runs():
    """`.ci/run` runs the README's two test commands; they stay one block, byte for byte."""
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    commands = [line for line in ci if line.startswith("bash tests/")]
    assert len(commands) == 2
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "```sh\n" + "\n".join(commands) + "\n```\n" in readme


def _drawing(page: Path) -> str:
    """A page's drawing of the processes: the fenced block that starts at the controller."""
    found = re.search(r"^```\ncontroller .*?^```$", page.read_text(encoding="utf-8"), re.M | re.S)
    assert found, f"{page.relative_to(REPO)} has no drawing of the processes"
    return found.group(0)


def test_the_readme_draws_the_processes_as_the_design_page_does():
    """One drawing, in two places (the front page, and Processes in the design page): a
    change to one that misses the other fails."""
    assert _drawing(REPO / "README.md") == _drawing(DOCS / "design.md")


def _walk_through(path: Path) -> str:
    """The walk-through's shell session (its first code block)."""
    text = path.read_text()
    section = text[text.index("walk-through\n") :]
    return section.split("```sh\n", 1)[1].split("```", 1)[0]


def test_the_sites_walk_through_is_the_readmes():
    """The site's Getting started page and the front page show one walk-through: a change
    to one that misses the other fails."""
    assert _walk_through(DOCS / "getting_started.md") == _walk_through(REPO / "README.md")

"""The data path: every module a proxied request runs through, compiled with mypyc at
install (`setup.py` compiles every module of this folder but this one). This module
chooses which runs: the build, or the Python source.

An install puts each compiled module's extension beside its .py (an editable install
builds them in place), and Python's import system prefers the extension. The source
runs instead when GYM_PROXY_PURE_PYTHON=1 (to compare the two, or to debug with plain
Python), when a source file differs from the one that was compiled (an edited module
must never run as its stale build), and when the extension files are not the ones the
build's manifest lists (a partial build). The choice is all or none, because mypyc calls
between the modules of one build directly; a mix would run old and new code together.

Only this interpreter's own build counts: its extension files (this ABI's suffix) and the
manifest setup.py wrote beside them for that ABI. A checkout built for two Pythons keeps
two builds, and an install that did not compile leaves an earlier build as it was.

`choose()` runs once, as this package is imported (so before any module of it is), and
must not import one itself.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path

__all__ = ["MANIFEST", "choose", "mode", "unexpected", "source_digest"]

PACKAGE_DIR = Path(__file__).resolve().parent
EXT_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # this ABI's, e.g. .cpython-311-...so
# Written by setup.py at build time: {module name: sha256 of the source compiled}.
MANIFEST = PACKAGE_DIR / ("_compiled_sources" + EXT_SUFFIX.removesuffix(".so") + ".json")

_mode = "python"
_reason = "not built (no compiled modules installed)"
_unexpected = False  # a build is there, but the source runs (not asked for)


def source_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def mode() -> tuple[str, str]:
    """("compiled" or "python", why): for the start-up log and the bench."""
    return _mode, _reason


def unexpected() -> bool:
    """Whether the source runs though a build of this Python is there (edited, partial,
    or its extensions gone): the start-up log says so as a warning, since the server
    then spends a third more CPU per request than its build would."""
    return _unexpected


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Loads the named modules from their .py files, ahead of the extension files."""

    def __init__(self, sources: dict[str, Path]) -> None:
        self.sources = sources

    def find_spec(
        self, fullname: str, path: object, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        source = self.sources.get(fullname)
        if source is None:
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def _extensions() -> dict[str, Path]:
    """Module name -> source, for every module of this package with an extension file
    of this ABI beside its source: what the import system would load compiled."""
    found = {}
    for path in PACKAGE_DIR.iterdir():
        if path.name.endswith(EXT_SUFFIX):
            source = PACKAGE_DIR / (path.name.removesuffix(EXT_SUFFIX) + ".py")
            if source.exists():
                found[f"{__package__}.{source.stem}"] = source
    return found


def _recorded() -> dict[str, str]:
    try:
        recorded: dict[str, str] = json.loads(MANIFEST.read_text())  # setup.py writes it
    except (OSError, ValueError):
        return {}
    return recorded


def choose() -> None:
    global _mode, _reason, _unexpected
    sources = _extensions()
    recorded = _recorded()
    if not sources:
        if recorded and os.environ.get("GYM_PROXY_PURE_PYTHON") != "1":
            _unexpected = True
            _reason = "the build's manifest is there but none of its compiled modules"
        return
    _unexpected = True
    if os.environ.get("GYM_PROXY_PURE_PYTHON") == "1":
        _unexpected = False
        _reason = "GYM_PROXY_PURE_PYTHON=1"
    elif set(recorded) != set(sources):
        # Extensions the manifest does not list (a build since undone, or one that
        # compiled only some modules): not a build we can vouch for.
        _reason = "the compiled modules do not match the build's manifest (partial or old build)"
    else:
        edited = sorted(
            name for name, digest in recorded.items() if source_digest(sources[name]) != digest
        )
        if not edited:
            _mode, _reason = "compiled", f"{len(sources)} modules compiled with mypyc"
            _unexpected = False
            return
        _reason = f"edited since the build: {', '.join(edited)} (pip install -e . rebuilds)"
    if any(name in sys.modules for name in sources):
        raise RuntimeError("data_path.choose() must run before the data path is imported")
    sys.meta_path.insert(0, _SourceFirst(sources))


choose()

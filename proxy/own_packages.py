"""gym-proxy's own top-level packages, claimed before a user's directory can shadow them.

`python -m proxy` (NeMo Gym's launcher runs `python -mproxy` in the server's directory)
puts the current directory first on `sys.path`, and `--app-dir` puts the app's there, so
a `worker.py` or `coordinator.py` beside the user's server would otherwise be imported in
place of gym-proxy's packages. The entry points import them first, from the directory
this package was installed in; once imported, their modules are found through the
packages themselves, whatever `sys.path` holds. Workers are started with `python -P`,
which never puts the current directory on `sys.path`.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

__all__ = ["ROOT", "claim"]

ROOT = Path(__file__).resolve().parent.parent


def claim(names: tuple[str, ...] = ("coordinator", "worker")) -> None:
    """Import gym-proxy's packages `names` from ROOT; exit naming the file if one of them
    was already imported from elsewhere."""
    for name in names:
        module = sys.modules.get(name)
        if module is None:
            sys.path.insert(0, str(ROOT))
            try:
                module = importlib.import_module(name)
            finally:
                sys.path.remove(str(ROOT))
        origin = Path(getattr(module, "__file__", None) or "").resolve()
        if origin.parent.parent != ROOT:
            sys.exit(
                f"gym-proxy: the module {name!r} was imported from {origin}, not from gym-proxy "
                f"({ROOT / name}); rename that file, or run gym-proxy from another directory"
            )

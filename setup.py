"""Build the proxy's data path with mypyc (everything else lives in pyproject.toml).

The modules every proxied request runs through are compiled to C extensions by mypyc
from the same typed Python: about 30% less CPU per request in process, about 4 us of
the 22 us the proxy spends per request under load (docs/design.md, bench/README.md).
The extensions are optional: a machine that cannot compile them installs the same
modules as Python, and GYM_PROXY_COMPILE=0 skips the compile on purpose. At run time
`proxy.data_path` picks the build or the source (GYM_PROXY_PURE_PYTHON=1, or a source
edited since the build).

The build's bookkeeping is one manifest per interpreter ABI, named like the extension
files it vouches for, and a build only ever writes its own, where its extensions go
(`BuildDataPath`): an editable install in place, a wheel or a plain `pip install .` in
its build folder. So an install that does not compile, one for another Python in the
same checkout, or a non-editable install run in a checkout cannot change which data
path an earlier build's interpreter runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The compile boundary is a folder: every module of proxy/data_path/ (what a proxied
# request runs through, and nothing that starts or stops things) but its __init__, which
# chooses between the build and the source.
DATA_PATH = Path("proxy") / "data_path"
COMPILED_MODULES = sorted(
    f"gym_proxy.proxy.data_path.{path.stem}"
    for path in DATA_PATH.glob("*.py")
    if path.name != "__init__.py"
)
# Read by proxy/data_path/__init__.py; e.g.
# proxy/data_path/_compiled_sources.cpython-311-x86_64-linux-gnu.json
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
MANIFEST = DATA_PATH / ("_compiled_sources" + EXT_SUFFIX.removesuffix(".so") + ".json")
SOURCES = {name: Path(*name.split(".")).with_suffix(".py") for name in COMPILED_MODULES}


def data_path_extensions() -> list[Extension]:
    if os.environ.get("GYM_PROXY_COMPILE", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:  # built without the build requirements (--no-build-isolation)
        return []
    try:
        extensions = mypycify(
            # mypy checks what is compiled; the modules it imports are checked by the test
            # suite's mypy, in a venv that has what they import (the build's isolated one
            # has only the build requirements: no OpenTelemetry, no aiohttp).
            ["--follow-imports=silent", *(str(path) for path in SOURCES.values())],
            opt_level="3",
            # Inside the folder (its shared library, compiled__mypyc, too): the wheel's
            # one top-level name stays gym_proxy, and the build stays within the boundary.
            group_name="gym_proxy.proxy.data_path.compiled",
        )
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error it finds
        print(f"gym-proxy: not compiling the data path ({exc!r}); it runs as Python")
        return []
    for extension in extensions:
        extension.optional = True  # no compiler: the Python modules are installed instead
    return extensions


class BuildDataPath(build_ext):
    """build_ext that keeps the manifest beside the extensions it builds, wherever they go
    (`--inplace` for an editable install: the checkout; otherwise the build folder)."""

    def run(self) -> None:
        if not self.extensions:
            super().run()
            return
        folder = Path(self.get_ext_fullpath(self.extensions[0].name)).parent
        # This ABI's earlier build there is replaced: should the C compiler fail this
        # time, none of its old extensions may stay to pass for the new sources.
        (folder / MANIFEST.name).unlink(missing_ok=True)
        for old in folder.glob("*" + EXT_SUFFIX):
            old.unlink()
        super().run()
        built = [Path(self.get_ext_fullpath(e.name)) for e in self.extensions]
        if not all(path.exists() for path in built):
            for path in built:  # an optional extension failed: none, not some
                path.unlink(missing_ok=True)
            print("gym-proxy: the data path did not compile; it runs as Python")
            return
        digests = {
            name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in SOURCES.items()
        }
        (folder / MANIFEST.name).write_text(json.dumps(digests, indent=1) + "\n")


setup(ext_modules=data_path_extensions(), cmdclass={"build_ext": BuildDataPath})

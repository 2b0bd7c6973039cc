"""Build the proxy's data path with mypyc (everything else lives in pyproject.toml).

The modules every proxied request runs through are compiled to C extensions by mypyc
from the same typed Python: about 30% less CPU per request in process, about 4 us of
the 22 us the proxy spends per request under load (README, "Bench"). The extensions are
optional: a machine that cannot compile them installs the same modules as Python, and
GYM_PROXY_COMPILE=0 skips the compile on purpose. At run time `proxy.data_path` picks
the build or the source (GYM_PROXY_PURE_PYTHON=1, or a source edited since the build).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from setuptools import Extension, setup

# Everything a proxied request runs through, and nothing that starts or stops things.
COMPILED_MODULES = [
    "proxy.client_connection",
    "proxy.exchange",
    "proxy.upstream",
    "proxy.outbox",
    "proxy.request_head",
    "proxy.response_head",
    "proxy.http_wire",
    "proxy.routing",
    "proxy.session_tokens",
]
MANIFEST = Path("proxy/_compiled_sources.json")  # read by proxy/data_path.py


def data_path_extensions() -> list[Extension]:
    MANIFEST.unlink(missing_ok=True)
    if os.environ.get("GYM_PROXY_COMPILE", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:  # built without the build requirements (--no-build-isolation)
        return []
    files = {name: Path(*name.split(".")).with_suffix(".py") for name in COMPILED_MODULES}
    try:
        extensions = mypycify(
            [str(path) for path in files.values()],
            opt_level="3",
            group_name="gym_proxy_data_path",
        )
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error it finds
        print(f"gym-proxy: not compiling the data path ({exc!r}); it runs as Python")
        return []
    for extension in extensions:
        extension.optional = True  # no compiler: the Python modules are installed instead
    digests = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in files.items()}
    MANIFEST.write_text(json.dumps(digests, indent=1) + "\n")
    return extensions


setup(ext_modules=data_path_extensions())

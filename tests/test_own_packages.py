"""A user's directory that holds `worker.py` or `coordinator.py` cannot shadow gym-proxy's
own packages: in the proxy (`python -m proxy` run there, as NeMo Gym's launcher runs it)
or in its workers (`--app-dir` first on sys.path)."""

from __future__ import annotations

import urllib.request

import orjson

from tests.support import ProxyProcess

APP = """
from aiohttp import web

async def hello(request):
    return web.json_response({"hello": "from the app"})

def create_app():
    app = web.Application()
    app.router.add_get("/hello", hello)
    return app
"""


def test_user_modules_named_like_gym_proxys_packages_do_not_shadow_them(tmp_path):
    for name in ("worker", "coordinator"):
        # Imported in place of gym-proxy's package, each would stop the process at once.
        (tmp_path / f"{name}.py").write_text(f"raise SystemExit('the user {name}.py ran')\n")
    (tmp_path / "hello_app.py").write_text(APP)
    proxy = ProxyProcess(
        "--app-dir", str(tmp_path), app="hello_app:create_app", workers=2, cwd=tmp_path
    )
    try:
        proxy.wait_ready()
        for _ in range(4):  # both workers serve (new sessions go to the least busy one)
            with urllib.request.urlopen(f"{proxy.url}/hello", timeout=10) as response:
                assert orjson.loads(response.read()) == {"hello": "from the app"}
        log = proxy.log()
        assert "ran" not in log.replace("gym-proxy", "")
        for name in ("worker", "coordinator"):
            assert f"{tmp_path / name}.py has the name of gym-proxy's package '{name}'" in log
    finally:
        proxy.close()

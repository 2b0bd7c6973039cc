"""A NeMo Gym server under plain `uvicorn --workers N` on one port, for the bench's
baseline: each uvicorn process builds the server exactly as gym-proxy's workers do
(`worker.nemo_gym_server.build_server_app`, NeMo Gym's own worker mode), but nothing
routes a session to the process that holds it.

    BENCH_NEMO_GYM_APP=module:Class uvicorn bench.nemo_gym_uvicorn:create_app --factory --workers N
"""

from __future__ import annotations

import os
from typing import Any

from gym_proxy.worker.app_loading import import_app_target
from gym_proxy.worker.nemo_gym_server import build_server_app


def create_app() -> Any:
    cls = import_app_target(os.environ["BENCH_NEMO_GYM_APP"])
    return build_server_app(cls, int(os.environ.get("WEB_CONCURRENCY", "1")))

"""The bench's skewed app on NeMo Gym (`bench/rebalance.py --app nemo_gym`): NeMo Gym's
own counter, `StatefulCounterResourcesServer` of the released package, unchanged, plus
`/block`, a handler that blocks its worker's event loop `?seconds=` (a verifier run
inline, a blocking client: the heavy sessions of NeMo Gym#3039). Run as NeMo Gym runs a
server class, with the config its launcher would pass (`config_env`)."""

from __future__ import annotations

import json
import socket
import time

from fastapi import FastAPI
from resources_servers.example_session_state_mgmt.app import StatefulCounterResourcesServer

INSTANCE = "counter"
SESSION_STATE = "session_id_to_counter"  # the counter's sessions, for moves


class SkewedCounter(StatefulCounterResourcesServer):
    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/block")(self.block)
        return app

    async def block(self, seconds: float = 0.1, cpu: int = 0) -> dict[str, float]:
        # As bench/skewed_app.py's: asleep, or computing for that much CPU time.
        if not cpu:
            time.sleep(seconds)  # noqa: ASYNC251 -- blocking the loop is what it is for
            return {"blocked": seconds}
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            pass
        return {"blocked": seconds}


def config_env() -> dict[str, str]:
    """NeMo Gym's config for one resources server, as its launcher hands it down."""
    with socket.socket() as probe:  # the head server's port: NeMo Gym asks for one
        probe.bind(("127.0.0.1", 0))
        head = probe.getsockname()[1]
    block = {"entrypoint": "app.py", "host": "127.0.0.1", "port": 1, "domain": "agent"}
    config = {
        "head_server": {"host": "127.0.0.1", "port": head},
        "dry_run": False,
        INSTANCE: {"resources_servers": {"example_session_state_mgmt": block}},
    }
    return {"NEMO_GYM_CONFIG_DICT": json.dumps(config), "NEMO_GYM_CONFIG_PATH": INSTANCE}

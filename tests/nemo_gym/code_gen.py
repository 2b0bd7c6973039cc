"""NeMo Gym's released code_gen resources server, for the tier's Ray tests: its config
block and the bodies of /verify calls whose program is right or wrong. Its verify runs
the program's unit tests as a Ray task (`check_correctness_remote.remote`)."""

from __future__ import annotations

from typing import Any

APP = "resources_servers.code_gen.app:CompCodingResourcesServer"
INSTANCE = "code_gen"
RIGHT = "n=int(input())\nprint(n*n)"  # squares its input: reward 1.0
WRONG = "n=int(input())\nprint(n+1)"  # reward 0.0


def config(port: int, head: int, **extra: Any) -> dict[str, Any]:
    """A global config with the code_gen instance on `port` (as its configs/code_gen.yaml
    has it, fewer processes for a 2-core machine), `extra` beside it."""
    block = {
        "entrypoint": "app.py",
        "domain": "coding",
        "host": "127.0.0.1",
        "port": port,
        "num_processes": 4,
        "unit_test_timeout_secs": 10,
        "debug": False,
    }
    return {
        "head_server": {"host": "127.0.0.1", "port": head},
        INSTANCE: {"resources_servers": {"code_gen": block}},
        **extra,
    }


def verify_body(code: str, n: int = 3) -> dict[str, Any]:
    """A /verify of `code` against one unit test: input n, expected n*n."""
    text = f"```python\n{code}\n```"
    return {
        "responses_create_params": {"input": [{"role": "user", "content": "square n"}]},
        "response": {
            "id": "resp",
            "created_at": 0.0,
            "model": "scripted",
            "object": "response",
            "output": [
                {
                    "id": "msg",
                    "content": [{"annotations": [], "text": text, "type": "output_text"}],
                    "role": "assistant",
                    "status": "completed",
                    "type": "message",
                }
            ],
            "parallel_tool_calls": False,
            "tool_choice": "auto",
            "tools": [],
        },
        "verifier_metadata": {"unit_tests": {"inputs": [f"{n}\n"], "outputs": [str(n * n)]}},
    }

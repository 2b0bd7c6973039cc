"""A driver joined to a Ray cluster that answers with Ray's state API (`ray.util.state`,
served by the head's dashboard), one JSON line per question read on stdin, until EOF:

    nodes        every node: {"node_id", "state", "is_head"}
    tasks NAME   every attempt of every task of that function name: {"task_id",
                 "attempt", "state", "node_id", "job_id", "error_type", "error"}
    actors CLASS every actor of that class, alive or dead: {"actor_id", "state",
                 "node_id", "name"}

    python -m tests.nemo_gym.ray_state ADDRESS

A process of its own so the test process never imports Ray. It joins with the
environment it is given (the cluster's RAY_AUTH_MODE and token). Its first line is
{"joined": ADDRESS} once `ray.init` returned; a failed question answers {"error": "..."}.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

LIMIT = 10_000  # the state API lists 100 by default
QUERY_TIMEOUT = 20  # seconds for one state API call (its default is 30)


def _answer(address: str, question: str) -> Any:
    from ray.util.state import list_actors, list_nodes, list_tasks

    kind, _, name = question.partition(" ")
    if kind == "nodes":
        nodes = list_nodes(address=address, limit=LIMIT, timeout=QUERY_TIMEOUT)
        return [{"node_id": n.node_id, "state": n.state, "is_head": n.is_head_node} for n in nodes]
    if kind == "tasks" and name:
        tasks = list_tasks(
            address=address,
            filters=[("name", "=", name)],
            limit=LIMIT,
            timeout=QUERY_TIMEOUT,
            detail=True,  # error_message is a detail column
            raise_on_missing_output=False,
        )
        return [
            {
                "task_id": t.task_id,
                "attempt": t.attempt_number,
                "state": t.state,
                "node_id": t.node_id,
                "job_id": t.job_id,
                "error_type": t.error_type,
                "error": (t.error_message or "").strip().split("\n")[0],
            }
            for t in tasks
        ]
    if kind == "actors" and name:
        actors = list_actors(
            address=address,
            filters=[("class_name", "=", name)],
            limit=LIMIT,
            timeout=QUERY_TIMEOUT,
            raise_on_missing_output=False,
        )
        return [
            {"actor_id": a.actor_id, "state": a.state, "node_id": a.node_id, "name": a.name}
            for a in actors
        ]
    return {"error": f"unknown question {question!r}"}


def main() -> None:
    address = sys.argv[1]
    # The answers keep stdout to themselves: Ray's driver prints cluster events there
    # (a node's death, even with log_to_driver off), so its fd 1 becomes stderr.
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import ray

    # The state API's address is the one given (several clusters run on this host).
    ray.init(address=address, log_to_driver=False)
    answers.write(json.dumps({"joined": address}) + "\n")
    for line in sys.stdin:
        try:
            reply = _answer(address, line.strip())
        except Exception as exc:  # one failed question is an answer, not the end
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(reply) + "\n")
    ray.shutdown()


if __name__ == "__main__":
    main()

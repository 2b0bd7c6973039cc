"""Run rollouts with NeMo Gym's own rollout collection (`gym eval run --no-serve`'s entry,
`RolloutCollectionHelper.run_from_config`), against servers already running, and print
one JSON line: how many finished, their rewards, the run's seconds and CPU seconds. A
process of its own: NeMo Gym's global aiohttp client belongs to one event loop per process.

    python -m tests.nemo_gym.drive CONFIG.yaml ROWS.jsonl OUT.jsonl AGENT CONCURRENCY
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import orjson


def main() -> None:
    config, rows, out, agent, concurrency = sys.argv[1:6]
    os.environ["NEMO_GYM_CONFIG_DICT"] = Path(config).read_text()
    from nemo_gym.rollout_collection import RolloutCollectionConfig, RolloutCollectionHelper

    collection = RolloutCollectionConfig(
        input_jsonl_fpath=rows,
        output_jsonl_fpath=out,
        agent_name=agent,
        num_samples_in_parallel=int(concurrency),
        route_failures_to_sidecar=True,
        upload_rollouts=False,
    )
    started, cpu = time.monotonic(), time.process_time()
    results = asyncio.run(RolloutCollectionHelper().run_from_config(collection))
    elapsed, cpu = time.monotonic() - started, time.process_time() - cpu
    rewards = {str(r["_ng_task_index"]): r.get("reward") for r in results}
    summary = {"finished": len(results), "seconds": elapsed, "cpu": cpu, "rewards": rewards}
    sys.stdout.write(orjson.dumps(summary).decode() + "\n")


if __name__ == "__main__":
    main()

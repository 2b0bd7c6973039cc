"""What one full pass of CPython's cyclic collector costs a worker, before and after
`freeze_startup_heap()` (coordinator/contract/collector.py).

    .venv313/bin/python bench/gc_pause.py

For each app, in a fresh interpreter: import it as a worker does
(`worker.app_loading.import_app_target`, with gym-proxy's worker code), then time full
collections (the best of five: a pass walks every tracked object, with the event loop
stopped while it does), freeze, and time them again. The apps are the NeMo Gym tier's
four servers (Python 3.13 with NeMo Gym: tests/nemo_gym/install.sh) and gym-proxy's own
test app. How often a full pass comes depends on the load (CPython starts one once the
objects that survived younger passes grow by a quarter of the old ones); what it costs,
every time, is this.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

APPS = [
    "responses_api_agents.simple_agent.app:SimpleAgent",
    "environment_servers.legacy_agent.app:LegacyAgentEnvironmentServer",
    "resources_servers.example_session_state_mgmt.app:StatefulCounterResourcesServer",
    "responses_api_models.openai_model.app:SimpleModelServer",
    "tests.apps:create_app",
]

PROBE = """
import gc, json, sys, time
import gym_proxy.worker.process
from gym_proxy.worker.app_loading import import_app_target
from gym_proxy.coordinator.contract.collector import freeze_startup_heap

import_app_target(sys.argv[1], ".")
gc.collect()

def best() -> float:
    times = []
    for _ in range(5):
        started = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - started)
    return min(times)

tracked = len(gc.get_objects())
before = best()
freeze_startup_heap()
after = best()
print(json.dumps({"tracked": tracked, "before": before, "after": after,
                  "frozen": gc.get_freeze_count()}))
"""


def probe(app: str) -> dict[str, float] | str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, app], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        return done.stderr.strip().splitlines()[-1]
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    print(f"Python {sys.version.split()[0]}")
    print("| app | objects the collector tracks | full pass | after freeze_startup_heap() |")
    print("|---|---|---|---|")
    for app in APPS:
        result = probe(app)
        if isinstance(result, str):
            print(f"| {app} | not measured: {result} | | |")
            continue
        print(
            f"| {app} | {result['tracked']:,.0f} | {result['before'] * 1000:.1f} ms "
            f"| {result['after'] * 1000:.2f} ms |"
        )


if __name__ == "__main__":
    main()

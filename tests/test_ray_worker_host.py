"""The placed worker's actor class (`proxy/ray_cluster/worker_host.py`) in a process of
its own, without Ray: an actor whose driver never asks it to start a worker (that driver
died while the actor waited for a node; its queued `start_here` died with it) ends
itself, and one that was asked lives on. The Ray side (placement, adoption, an orphaned
worker's actor) is the NeMo Gym tier's (`tests/test_nemo_gym_ray_placement.py`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO

pytestmark = pytest.mark.fast

LIVES_ON = 3  # the script's own exit code: the host did not end the process


@pytest.mark.parametrize(("asked", "code"), [(False, 0), (True, LIVES_ON)])
def test_a_host_never_asked_to_start_a_worker_ends_itself(asked, code):
    script = (
        "import os, time\n"
        "from gym_proxy.proxy.ray_cluster import worker_host\n"
        "worker_host.UNASKED_AFTER = 0.2\n"
        "host = worker_host.RayWorkerHost()\n"
        f"if {asked}: host.asked.set()  # what start_here does first\n"
        "time.sleep(2)\n"
        f"os._exit({LIVES_ON})\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == code, result

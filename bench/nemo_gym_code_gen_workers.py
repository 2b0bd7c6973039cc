"""NeMo Gym's released code_gen server, as the entrypoint of NeMo Gym's own multi-worker
path (`num_workers: N`), for bench/ray_verifier.py.

With `num_workers > 1`, NeMo Gym's `run_webserver()` runs
`uvicorn.run("<type>.<name>.<entrypoint module>:app", workers=N)`, and each uvicorn worker
gets its app from that module's `app`. NeMo Gym's servers that support the path end with
a clause building it (`elif is_nemo_gym_fastapi_entrypoint(__file__): app =
<Server>.run_webserver()`: job_bench, workspace_bench, denovo_swe, ...); code_gen's
released app.py has none, so under `num_workers: 2` its workers fail with `Attribute
"app" not found in module "resources_servers.code_gen.app"` and nothing serves. This
module is that clause and nothing else: the bench puts it in a server directory of its
own (`resources_servers/code_gen_workers/app.py`), and the server class is code_gen's,
imported unmodified (its directory on `PYTHONPATH`, for its bare `lcb_integration`).
"""

from nemo_gym.server_utils import is_nemo_gym_fastapi_entrypoint
from resources_servers.code_gen.app import CompCodingResourcesServer

if __name__ == "__main__":
    CompCodingResourcesServer.run_webserver()
elif is_nemo_gym_fastapi_entrypoint(__file__):
    app = CompCodingResourcesServer.run_webserver()

"""The server's one Ray cluster, and its workers placed on the cluster's nodes
(`--worker-placement ray`); the proxy's only part that knows Ray.

- `cluster`: which cluster the workers join, started, checked, taken over and stopped in
  the proxy, through `head`, the process that starts or checks it and holds it;
- `remote_workers`: the launcher of placed workers (`RayLauncher`, a
  `proxy.fleet.supervision.launchers.WorkerLauncher`) and their handles (`RemoteWorker`, a
  `proxy.fleet.supervision.worker_records.PlacedHandle`), in the proxy, through `placement`, the Ray
  driver process that owns their actors (`worker_host`, one per worker on a node);
- `worker_port`: a placed worker's listening socket; `node_zygote`: `--preload` on the
  cluster, one zygote per node that forks the node's placed workers;
- `mixed`: a server of local and placed workers (`--local-workers`), a launcher that
  starts each slot's worker with one or the other;
- `lines`: what those processes say to the proxy, each protocol declared once for both
  ends; `errors`: what goes wrong with the cluster, as the user hears it.

The dependency goes one way: this folder may import the fleet (whose protocols its
launcher fills), the fleet nothing of this one, so the supervisor and the live
operations run placed workers as local ones, without knowing where they run
(`tests/test_import_graph.py` keeps folders from importing each other).
"""

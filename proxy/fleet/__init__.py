"""The proxy's workers: the supervisor that starts, watches and replaces them, and the
live operations it runs on them.

- the supervisor (`supervisor`): its records of workers, their handles and launchers
  (`worker_records`), its slot table (`slots`), its liveness pings (`liveness`), the
  zygote's client under `--preload` (`zygote_client`), adopting a predecessor's workers
  (`adoption`; a session two of them hold: `adopted_copies`) and what only the proxy
  knew, kept for a successor (`intent`);
- the live operations: session moves (`mover`; the router's side of them, holds and
  placements: `move_table`; waiting for requests to end: `session_watch`), drain,
  undrain, resize, rolling restart and recycle (`operations`; when to recycle:
  `recycling`), emptying and stopping a worker (`decommission`) and handing running
  `/run` episodes over (`handovers`);
- the load each worker carries (`load`), the rebalance that follows it (`balancer`, its
  policy `rebalance`) and the worker count that follows demand (`autoscale`).

Where a worker runs is its launcher's business: the fleet knows workers on a Ray
cluster's nodes only as `worker_records.WorkerLauncher` and `worker_records.PlacedHandle`
(`proxy.ray_cluster` fills them) and imports nothing of the Ray side.

The operations change the supervisor's worker records and the router's tables (through
the supervisor's `WorkerPool` and `MoveTable` views), so they live beside the supervisor,
not in `coordinator/`, as gunicorn's worker management is its Arbiter's. Checkpoints and
operations exclude each other through one object (`coordinator.exclusion.Exclusion`, the
checkpointer's).
"""

"""The proxy's workers: the supervisor that starts, watches and replaces them, and the
live operations it runs on them.

- `fleet.supervision`: the supervisor and what it keeps (its records, slots, liveness
  pings, the zygote's client, adoption, the kept intent);
- `fleet.moves`: sessions moved while they serve, and episodes handed over;
- `fleet.operations`: the live operations (drain, resize, rolling restart, recycle) and
  the decommission step they share;
- `fleet.balance`: the load each worker carries, the rebalance and the autoscale.

Each uses only the ones above it in that order, and the moves none of them: no circle
(`tests/test_import_graph.py`).

Where a worker runs is its launcher's business: the fleet knows workers on a Ray
cluster's nodes only as `supervision.launchers.WorkerLauncher` and
`supervision.worker_records.PlacedHandle`
(`proxy.ray_cluster` fills them) and imports nothing of the Ray side.

The operations change the supervisor's worker records and the router's tables (through
the supervisor's `WorkerPool` and `MoveTable` views), so they live beside the supervisor,
not in `coordinator/`, as gunicorn's worker management is its Arbiter's. Checkpoints and
operations exclude each other through one object (`coordinator.exclusion.Exclusion`, the
checkpointer's).
"""

"""The proxy's workers: the supervisor that starts, watches and replaces them
(`supervisor`; its records of slots and workers are `worker_records`), and the live
operations it runs on them: session moves (`mover`), drain, undrain, resize, rolling
restart and recycle (`operations`), emptying and stopping a worker (`decommission`) and
handing running `/run` episodes over (`handovers`).

The operations change the supervisor's worker records and the router's tables (through
the supervisor's `WorkerPool` and `MoveTable` views), so they live beside the supervisor,
not in `coordinator/`, as gunicorn's worker management is its Arbiter's. Checkpoints and
operations exclude each other through one object (`coordinator.exclusion.Exclusion`, the
checkpointer's).
"""

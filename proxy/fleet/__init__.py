"""The live operations the proxy runs on its own workers: session moves (`mover`),
drain, undrain, resize, rolling restart and recycle (`operations`), emptying and
stopping a worker (`decommission`) and handing running `/run` episodes over (`handovers`).

They change the proxy's worker records and routing tables (through the supervisor's
`WorkerPool` and `MoveTable` views), so they live beside the supervisor, not in
`coordinator/`; checkpoints and operations exclude each other through one object
(`coordinator.exclusion.Exclusion`, the checkpointer's).
"""

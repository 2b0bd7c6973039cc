"""The workers' supervision: the supervisor (`supervisor`) that starts, watches and
replaces them, its records of workers and their handles (`worker_records`), what starts
them (`launchers`; the zygote's client under `--preload`: `zygote_client`), its slot
table (`slots`), its liveness pings (`liveness`), adopting a predecessor's workers
(`adoption`; a session two of them hold: `adopted_copies`) and what only the proxy
knew, kept for a successor (`intent`)."""

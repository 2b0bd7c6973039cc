"""The workers' supervision: the supervisor (`supervisor`) that starts, watches and
replaces them, its records of workers, their handles and launchers (`worker_records`),
its slot table (`slots`), its liveness pings (`liveness`), the zygote's client under
`--preload` (`zygote_client`), adopting a predecessor's workers (`adoption`; a session
two of them hold: `adopted_copies`) and what only the proxy knew, kept for a successor
(`intent`)."""

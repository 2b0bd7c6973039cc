"""What gym-proxy's processes share and the checkpoint coordinator: the contract every
process speaks (`coordinator.contract`: messages, framing, headers, ids, exit codes), the
coordinator the proxy hosts (the checkpointer, its commit write and its restore, its
phase machine, readiness, placement, the checkpoint files, the restored claims carried
across a crash and the worker channels, the exclusion it shares with the live operations
and the fan-out to every worker), and the control-plane clients behind
`gym-proxy-ctl` and `gym-proxy-rollouts` (`coordinator.clients`). The live operations
(moves, drain, resize, restarts, hand-overs) are the proxy's: `proxy/fleet/`."""

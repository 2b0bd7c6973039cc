"""gym-proxy's checkpoint coordination: the contract every process shares
(`coordinator.contract`), the coordinator the proxy hosts (the checkpointer, its phase
machine, readiness, placement, the checkpoint files and the worker channels), and the
control-plane clients behind `gym-proxy-ctl` and `gym-proxy-rollouts`
(`coordinator.clients`)."""

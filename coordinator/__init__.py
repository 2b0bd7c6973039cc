"""What gym-proxy's processes share and the checkpoint coordinator the proxy hosts.

- `coordinator.contract`: the contract every process speaks (messages, framing, headers,
  ids, exit codes, the control plane's answers);
- the coordinator: `checkpointer` (the phase machine it drives, `phases`; readiness
  rolled up, `readiness`), its commit's file write (`commit_write`), its restore
  (`restore`, each session assigned by `assignment`), the checkpoint files (`checkpoint_files`), the
  restored claims carried across a crash (`claims_recovery`), the worker channels
  (`worker_channels`), the exclusion it shares with the live operations (`exclusion`)
  and the fan-out to every worker (`broadcast`);
- `coordinator.clients`: the control-plane clients behind `gym-proxy-ctl` and
  `gym-proxy-rollouts`.

The live operations (moves, drain, resize, restarts, hand-overs) are the proxy's:
`proxy/fleet/`."""

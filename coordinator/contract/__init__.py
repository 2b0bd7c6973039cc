"""The ground floor: what the proxy, the workers and the coordinator all rely on.

One concern per module, and nothing here imports a floor above (`proxy`, `worker`, the
coordinator's own modules) or does anything on import:

- `errors`: every error code, its HTTP status and the one JSON body;
- `ids`: the rules for session, owner, checkpoint and rollout IDs;
- `headers`: the header names and the `/ng-rollout/` prefix proxy and workers speak;
- `episodes`: episode identity, and NeMo Gym's rollout IDs in request bodies;
- `app_sessions`: the session an app's own cookie or MCP token names;
- `nemo_gym_env`: the environment variables NeMo Gym's launcher hands a server its
  config in;
- `exit_codes`, `keepalive`: every process's exit statuses, and the keep-alive rule
  proxy and workers agree on;
- `framing`, `channel`, `messages`: the coordinator channel, its frames and its messages;
- `answers`: what the control plane answers, typed, for the server and its clients;
- `lines`, `zygote_lines`: the JSON-lines protocols between the other processes, and the
  zygote's messages (the Ray processes' are `proxy.ray_cluster.lines`: both their ends
  are the proxy's);
- `worker_link`: the authenticated link to a worker Ray placed;
- `records`: the checkpoint record format (NeMo Gym's);
- `marks`: retire marks and restored claims;
- `state_files`, `trust`: the runtime directory's state files, and what is believed of a
  path or a peer;
- `collector`, `loop_lag`, `process_memory`, `telemetry`, `failpoints`: the garbage
  collector held off around a checkpoint, the event loop's lag, a process's resident
  memory, OpenTelemetry, crash points for tests.
"""

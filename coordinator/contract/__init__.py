"""The ground floor: what the proxy, the workers and the coordinator all rely on.

One concern per module, and nothing here imports a floor above (`proxy`, `worker`, the
coordinator's own modules) or does anything on import:

- `errors`: every error code, its HTTP status and the one JSON body;
- `ids`: the rules for session, owner, checkpoint and rollout IDs;
- `headers`: the header names and the `/ng-rollout/` prefix proxy and workers speak;
- `episodes`: episode identity, and NeMo Gym's rollout IDs in request bodies;
- `app_sessions`: the session an app's own cookie or MCP token names;
- `exit_codes`, `keepalive`: what a worker process and the proxy agree on;
- `framing`, `channel`, `messages`: the coordinator channel, its frames and its messages;
- `records`: the checkpoint record format (NeMo Gym's);
- `marks`: retire marks and restored claims.
"""

"""Reference servers: a NeMo Gym-shaped stack that runs under gym-proxy.

`weather` (resources, FastAPI), `fake_model` (model, aiohttp), `simple_agent` (agent,
aiohttp) and `single_turn` (environment, FastAPI); `stack` starts them all, each behind
its own gym-proxy. What they share: `episode_steps`, the weather episode both `/run`s
play; `calls`, how they call each other (a call that meets a checkpoint is repeated);
`rollout_prefix`, the `/ng-rollout/<key>/` strip an ASGI app needs; `hold`, a switch
that keeps chosen calls waiting (rollouts in flight for tests and benches). See
"Reference stack" in docs/participant_api.md.
"""

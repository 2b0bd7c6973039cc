"""Reference servers: a NeMo Gym-shaped stack that runs under gym-proxy.

`weather` (resources, FastAPI), `fake_model` (model, aiohttp), `simple_agent` (agent,
aiohttp) and `single_turn` (environment, FastAPI); `stack` starts them all, each behind
its own gym-proxy. See "Reference stack" in docs/participant_api.md.
"""

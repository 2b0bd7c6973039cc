"""gym-proxy worker: one process running the server's app (aiohttp, ASGI or a NeMo Gym
server class) on a private Unix socket, with the participant runtime in front of it."""

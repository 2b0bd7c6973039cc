"""gym-proxy worker: one process running the server's aiohttp app on a private socket."""

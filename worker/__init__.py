"""gym-proxy worker: one process running the server's app (aiohttp, ASGI or a NeMo Gym
server class) on a private Unix socket, with the participant runtime in front of it.

Its modules, one concern each (`tests/test_doc_names.py` checks that every one is named
here):

- **the process**: `worker.process` its life cycle (`WorkerServer`: startup, serve,
  shutdown on one exit stack; `python -m gym_proxy.worker` is `worker.__main__`),
  `worker.options` its command line (`WorkerArgs`), `worker.zygote` the `--preload`
  process that forks workers, `worker.app_loading` the APP found and built,
  `worker.nemo_gym_server` a NeMo Gym server class as APP, the app's server
  (`worker.aiohttp_server`, `worker.asgi_server`) and the head limits both parse with
  (`worker.head_limits`), and a placed worker's port (`worker.link_gate`);
- **the front doors** in front of the app: `worker.aiohttp_door` (a middleware),
  `worker.asgi_door` (a request or WebSocket through it is a cycle object), and where an
  ASGI app keeps its own sessions (`worker.app_sessions`);
- **the participant runtime**: `worker.runtime` its state and the way of a request
  through it, `worker.flights` a request in flight, `worker.readiness` the readiness
  reports, `worker.session_ends` the sessions that end, `worker.state_records` the
  state's records out and in, `worker.attempts` restored claims and retired attempts,
  `worker.handovers` episodes handed over, `worker.sessions` the session store,
  `worker.session_load` what each session costs, `worker.moved_away` the sessions moved
  away, and `worker.channel_requests` the coordinator's requests served;
- **what an app uses**: `worker.participant` the API, `worker.declaration` how it takes
  part, `worker.request_context` one request as it sees it, `worker.episodes` the
  episode context, `worker.identity` its worker and session, `worker.session_dicts`
  session state kept in a dict of its own;
- **apps**: `worker.counter` the default APP, and `worker.apps` the reference stack.
"""

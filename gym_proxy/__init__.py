"""gym-proxy: one stateful RL environment server as N worker processes behind one port.

The one name gym-proxy installs. Its parts are `gym_proxy.proxy` (the proxy process),
`gym_proxy.worker` (the worker processes and the participant API) and
`gym_proxy.coordinator` (what every process shares, the checkpoint coordinator and the
live operations the proxy hosts, the control-plane clients); in the source tree they
are the folders `proxy/`, `worker/` and `coordinator/`, which this package's entries
link to.
"""

"""gym-proxy: one public port, N workers, sessions routed to the worker that holds them."""

from gym_proxy.proxy import data_path

# Before any module of the data path is imported: the compiled build or the source.
data_path.choose()

"""gym-proxy: one public port, N workers, sessions routed to the worker that holds them."""

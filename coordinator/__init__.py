"""gym-proxy coordinator: the framed channel between the proxy and its workers."""

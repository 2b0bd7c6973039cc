"""The server's one Ray cluster: what the proxy does with it (`cluster`) and the process
that starts or checks it (`head`)."""

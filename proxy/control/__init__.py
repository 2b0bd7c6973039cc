"""The control plane the proxy serves on its private socket: the checkpoint calls of
NeMo Gym's Gen-2 contract and the live operations on the workers (`app`)."""

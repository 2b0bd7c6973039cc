"""`python -m gym_proxy`: the `gym-proxy` command (what NeMo Gym's launcher runs as
`entrypoint: -mgym_proxy`)."""

from gym_proxy.proxy.cli import hold_operation_signals, main

hold_operation_signals()  # first: until the server handles them, they must not end it
main()

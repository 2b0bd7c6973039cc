"""`python -m gym_proxy.proxy`: the same as `python -m gym_proxy`."""

from gym_proxy.proxy.cli import hold_operation_signals, main

hold_operation_signals()  # first: until the server handles them, they must not end it
main()

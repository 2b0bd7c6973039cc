from proxy.cli import hold_operation_signals, main

hold_operation_signals()  # first: until the server handles them, they must not end it

from proxy.own_packages import claim  # noqa: E402

claim()  # before proxy.startup imports them: a user directory must not shadow them
main()

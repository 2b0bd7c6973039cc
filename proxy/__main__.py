"""`python -m gym_proxy.proxy`: the same as `python -m gym_proxy`."""

from gym_proxy.proxy.cli import main  # imports nothing slow: main() holds the signals first

main()

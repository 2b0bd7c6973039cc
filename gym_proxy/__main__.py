"""`python -m gym_proxy`: the `gym-proxy` command (what NeMo Gym's launcher runs as
`entrypoint: -mgym_proxy`)."""

from gym_proxy.proxy.cli import main  # imports nothing slow: main() holds the signals first

main()

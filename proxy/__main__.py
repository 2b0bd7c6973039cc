from proxy.own_packages import claim

claim()  # before proxy.cli imports them: a user directory must not shadow them

from proxy.cli import main  # noqa: E402

main()

#!/usr/bin/env bash
# Debian packages the tests drive, each installed once, as root or through sudo:
#   bash tests/install_debian.sh COMMAND=PACKAGE ...
# installs PACKAGE when COMMAND is not on the PATH (tests/install_prometheus.sh and
# tests/install_chromium.sh name theirs).
set -euo pipefail
missing=()
for pair in "$@"; do
    command -v "${pair%%=*}" >/dev/null || missing+=("${pair#*=}")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
as_root=()
if [ "$(id -u)" -ne 0 ]; then
    as_root=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
if ! "${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"; then
    "${as_root[@]}" apt-get update -q
    "${as_root[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

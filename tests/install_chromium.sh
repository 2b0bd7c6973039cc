#!/usr/bin/env bash
# Debian's chromium, which tests/test_status_page.py drives headless to load the status
# page (a real browser runs its script); installed once, as root or through sudo.
set -euo pipefail
if command -v chromium >/dev/null; then
    exit 0
fi
as_root=()
if [ "$(id -u)" -ne 0 ]; then
    as_root=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
if ! "${as_root[@]}" apt-get install -y -q --no-install-recommends chromium; then
    "${as_root[@]}" apt-get update -q
    "${as_root[@]}" apt-get install -y -q --no-install-recommends chromium
fi

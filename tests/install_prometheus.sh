#!/usr/bin/env bash
# Debian's prometheus package (the Prometheus server and promtool), which
# tests/test_metrics.py starts and lints with; installed once, as root or through sudo.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    exit 0
fi
as_root=()
if [ "$(id -u)" -ne 0 ]; then
    as_root=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
if ! "${as_root[@]}" apt-get install -y -q --no-install-recommends prometheus; then
    "${as_root[@]}" apt-get update -q
    "${as_root[@]}" apt-get install -y -q --no-install-recommends prometheus
fi

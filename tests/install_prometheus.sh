#!/usr/bin/env bash
# Debian's prometheus package (the Prometheus server and promtool), which
# tests/test_metrics.py starts and lints with; installed once, as root or through sudo.
exec bash "$(dirname "$0")/install_debian.sh" prometheus=prometheus promtool=prometheus

#!/usr/bin/env bash
# Debian's chromium, which tests/test_status_page.py drives headless to load the status
# page (a real browser runs its script); installed once, as root or through sudo.
exec bash "$(dirname "$0")/install_debian.sh" chromium=chromium

#!/usr/bin/env bash
# Create a Python 3.13 virtualenv with gym-proxy (editable, with its test extras) and the
# released NeMo Gym 0.7.0 plus what its tested import chain needs (requirements.txt here).
# Usage: bash tests/nemo_gym/install.sh VENV_DIR
set -euo pipefail
venv=${1:?usage: install.sh VENV_DIR}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
python=""
for candidate in python3.13 "$(pyenv root 2>/dev/null)/versions/3.13"*/bin/python3.13; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 13)' 2>/dev/null; then
        python=$candidate
        break
    fi
done
[ -n "$python" ] || { echo "install.sh: no Python 3.13 found (python3.13, or pyenv's 3.13)" >&2; exit 2; }
"$python" -m venv "$venv"
# nemo-gym 0.7.0 declares Requires-Python >=3.13.14; the machine image has 3.13.0, on which
# the tested path runs (the suite checks it), hence --ignore-requires-python. --no-deps:
# requirements.txt is the whole closure, pinned, without the heavy unused dependencies.
"$venv/bin/pip" install --quiet --no-deps --ignore-requires-python \
    -r "$here/requirements.txt"
"$venv/bin/pip" install --quiet -e "$repo[test]"

#!/usr/bin/env bash
# The NeMo Gym tier's virtualenv: the documented install (docs/examples/nemo_gym/install.sh:
# NeMo Gym 0.7.0 and the real Ray beside gym-proxy, Python 3.13), with gym-proxy's test
# extras, and the requirements of the released resources servers the tier and the benches
# run beyond NeMo Gym's own (servers-requirements.txt), as a NeMo Gym user installs a
# server's requirements.txt. Usage: bash tests/nemo_gym/install.sh VENV_DIR
# What the documented install printed is kept in VENV_DIR/install.log: the tier checks it
# says pip's resolver block is expected before pip prints it (tests/test_nemo_gym_install.py).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:?usage: install.sh VENV_DIR}
log=$(mktemp)
bash "$here/../../docs/examples/nemo_gym/install.sh" "$venv" test 2>&1 | tee "$log"
mv "$log" "$venv/install.log"
"$venv/bin/pip" install --quiet -r "$here/servers-requirements.txt"

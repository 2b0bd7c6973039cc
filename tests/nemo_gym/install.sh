#!/usr/bin/env bash
# The NeMo Gym tier's virtualenv: the documented install (docs/examples/nemo_gym/install.sh:
# NeMo Gym 0.7.0 and the real Ray beside gym-proxy, Python 3.13), with gym-proxy's test
# extras. Usage: bash tests/nemo_gym/install.sh VENV_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec bash "$here/../../docs/examples/nemo_gym/install.sh" "${1:?usage: install.sh VENV_DIR}" test

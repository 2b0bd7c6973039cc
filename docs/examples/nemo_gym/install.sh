#!/usr/bin/env bash
# Install NeMo Gym 0.7.0 beside gym-proxy in a new Python 3.13 virtualenv.
#
#   bash docs/examples/nemo_gym/install.sh VENV_DIR [EXTRAS]
#
# gym-proxy is installed from this clone (editable; EXTRAS, e.g. `test`, as pip extras).
# nemo-gym 0.7.0 declares Requires-Python >=3.13.14:
#  - on such a Python, NeMo Gym is installed as released, with its declared dependencies;
#  - on an older 3.13 (this project's machine image has 3.13.0, where the whole NeMo Gym
#    tier runs), pip would refuse it, so the closure NeMo Gym's servers, launcher,
#    rollout collection and Ray actually import is installed, pinned, from
#    requirements.txt beside this script, with --ignore-requires-python --no-deps.
# Either way Ray is the real ray NeMo Gym pins (2.60.0).
set -euo pipefail
venv=${1:?usage: install.sh VENV_DIR [EXTRAS]}
extras=${2:+[$2]}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
python=""
for candidate in python3.13 "$(pyenv root 2>/dev/null)/versions/3.13"*/bin/python3.13; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 13)' 2>/dev/null; then
        python=$candidate
        break
    fi
done
[ -n "$python" ] || { echo "install.sh: no Python 3.13 found (python3.13, or pyenv's 3.13)" >&2; exit 2; }
"$python" -m venv "$venv"
if "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 13, 14))'; then
    "$venv/bin/pip" install --quiet "nemo-gym==0.7.0" "ray==2.60.0"
else
    echo "install.sh: $("$venv/bin/python" -V) is older than nemo-gym 0.7.0's 3.13.14: installing its pinned closure (requirements.txt)" >&2
    "$venv/bin/pip" install --quiet --no-deps --ignore-requires-python -r "$here/requirements.txt"
    # Said before pip says it, so that nobody takes it for a failed install.
    echo "install.sh: pip may now end with \"ERROR: pip's dependency resolver does not currently take into account ...\" and lines \"nemo-gym 0.7.0 requires X, which is not installed\": expected, for the declared dependencies of NeMo Gym's that this closure leaves out (none of them is imported); the install goes on" >&2
fi
"$venv/bin/pip" install --quiet -e "$repo$extras"

#!/usr/bin/env bash
# The NeMo Gym quick start: NeMo Gym's own stack with its counter under gym-proxy.
#
#   bash docs/examples/nemo_gym/quickstart.sh [OVERRIDE ...]   (from a clone of gym-proxy)
#
# Each OVERRIDE is a NeMo Gym config override (Hydra's syntax) added to the launcher's
# and the rollout collection's, e.g.
# ++counter.resources_servers.example_session_state_mgmt.gym_proxy.workers=4.
#
# 1. installs NeMo Gym 0.7.0, Ray and gym-proxy into .venv313 (install.sh here), unless
#    that venv exists (QUICKSTART_VENV names another);
# 2. starts the project's scripted policy model (it stands in for an LLM: offline);
# 3. starts NeMo Gym's launcher (`gym env start`) with config.yaml here: its head server,
#    simple_agent, legacy_agent and openai_model in one process each, the counter under gym-proxy with
#    2 workers;
# 4. runs NeMo Gym's rollout collection in its CLI form (`gym eval run --no-serve`, which
#    `ng_collect_rollouts` now runs) over rows.jsonl here and prints each rollout's reward;
# 5. takes a checkpoint of the counter with gym-proxy-ctl;
# 6. stops everything it started (also on Ctrl-C or a failure).
# Its files (logs, rollouts, the checkpoint) go to a new folder under /tmp, printed first.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
venv=${QUICKSTART_VENV:-$repo/.venv313}
work=$(mktemp -d /tmp/gym-proxy-quickstart.XXXXXX)
echo "quickstart: files in $work"

[ -x "$venv/bin/gym" ] || bash "$here/install.sh" "$venv"

# Fixed ports (config.yaml): below the ephemeral range and above Ray's worker ports
# (10002-19999), so neither an outgoing connection nor a Ray worker takes one by chance.
for port in 28400 28401 28402 28403 28404 28405; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        echo "quickstart: port $port is in use; config.yaml's ports 28400-28405 must be free" >&2
        exit 1
    fi
done

launcher="" model=""
stop() {
    # Ctrl-C for the launcher: it stops its servers (gym-proxy stops its workers) and Ray.
    if [ -n "$launcher" ] && kill -0 "$launcher" 2>/dev/null; then
        kill -INT "$launcher"
        for _ in $(seq 600); do kill -0 "$launcher" 2>/dev/null || break; sleep 0.1; done
        kill -KILL -- "-$launcher" 2>/dev/null || true
    fi
    [ -z "$model" ] || kill "$model" 2>/dev/null || true
    wait 2>/dev/null || true
}
trap stop EXIT
trap 'exit 130' INT TERM

# The servers' venvs, as the launcher looks for them (<uv_venv_dir>/<type>/<name>/.venv):
# links to the one venv (skip_venv_if_present in config.yaml uses them as they are).
for server in resources_servers/example_session_state_mgmt responses_api_agents/simple_agent \
    responses_api_models/openai_model environment_servers/legacy_agent; do
    mkdir -p "$work/venvs/$server"
    ln -s "$venv" "$work/venvs/$server/.venv"
done
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/secret"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/control-token"
chmod 600 "$work/secret" "$work/control-token"

PYTHONPATH=$repo "$venv/bin/python" -m tests.nemo_gym.scripted_model 28404 \
    > "$work/model.log" 2>&1 &
model=$!

counter=counter.resources_servers.example_session_state_mgmt.gym_proxy
settings=(
    "+config_paths=[$here/config.yaml]"
    "+uv_venv_dir=$work/venvs"
    "+policy_base_url=http://127.0.0.1:28404/v1"
    "++$counter.secret_file=$work/secret"
    "++$counter.control_token_file=$work/control-token"
    "++$counter.runtime_dir=$work"
    "$@"
)
# A failure: gym-proxy's own lines first (each says what is wrong in one line), then the
# end of the log, where NeMo Gym's traceback of the same failure is.
failed() {
    echo "quickstart: failed; gym-proxy said:" >&2
    grep -E "gym-proxy: error:|gym-proxy (ERROR|WARNING)" "$1" >&2 || echo "  (nothing)" >&2
    echo "quickstart: the end of $1:" >&2
    tail -n 40 "$1" >&2
}
(cd "$work" && exec setsid "$venv/bin/gym" env start "${settings[@]}") > "$work/launcher.log" 2>&1 &
launcher=$!
echo "quickstart: starting NeMo Gym's launcher (log: $work/launcher.log)"
for _ in $(seq 3000); do  # up to 5 minutes: Ray and four Python servers on a small machine
    grep -q "All 4 / 4 servers ready" "$work/launcher.log" && break
    kill -0 "$launcher" 2>/dev/null || { failed "$work/launcher.log"; exit 1; }
    sleep 0.1
done
grep -q "All 4 / 4 servers ready" "$work/launcher.log" || {
    echo "quickstart: the servers were not ready in 5 minutes" >&2; exit 1; }
echo "quickstart: NeMo Gym's stack is up; the counter runs on 2 gym-proxy workers"

(cd "$work" && "$venv/bin/gym" eval run --no-serve "${settings[@]}" \
    +agent_name=agent "+input_jsonl_fpath=$here/rows.jsonl" \
    "+output_jsonl_fpath=$work/rollouts.jsonl" +num_samples_in_parallel=4) \
    > "$work/rollouts.log" 2>&1 || { tail -n 40 "$work/rollouts.log" >&2; exit 1; }
"$venv/bin/python" - "$here/rows.jsonl" "$work/rollouts.jsonl" <<'EOF'
import json, sys
tasks = [json.loads(line) for line in open(sys.argv[1])]
rollouts = sorted((json.loads(line) for line in open(sys.argv[2])), key=lambda r: r["_ng_task_index"])
for rollout in rollouts:
    task = tasks[rollout["_ng_task_index"]]
    prompt = task["responses_create_params"]["input"][0]["content"]
    print(f"rollout {rollout['_ng_task_index']}: from {task['initial_count']}, {prompt}: "
          f"expected {task['expected_count']}, reward {rollout['reward']}")
print(f"{sum(r['reward'] == 1.0 for r in rollouts)} of {len(rollouts)} rollouts scored 1.0")
EOF

GYM_PROXY_CONTROL_TOKEN=$(cat "$work/control-token") "$venv/bin/gym-proxy-ctl" \
    --server http://127.0.0.1:28401 checkpoint quickstart "$work/checkpoint" \
    > "$work/checkpoint.json"
"$venv/bin/python" - "$work/checkpoint.json" <<'EOF'
import json, sys
result = json.load(open(sys.argv[1]))
print("checkpoint:", result["summary"])
EOF
echo "quickstart: stopping"

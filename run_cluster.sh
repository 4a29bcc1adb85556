#!/usr/bin/env bash
# Start a layerbus broker and N local stages against a job store; stop every one of them on exit.
#
#   ./run_cluster.sh [--stages N] [--model DIR] [--db URL] [--log-dir DIR] [--port P] [--remote-stages K]
#                    [--keys DIR [--allow DIR]... | --insecure] [--advertise HOST]
#   ./run_cluster.sh stage --broker tcp://HOST:PORT [layerbus stage options: --keys DIR --broker-key FILE ...]
#
# The first form runs `layerbus broker` (control on port P, results on P+1) and N local `layerbus stage`
# processes, then serves the store's queued jobs (`layerbus submit ...`) until Ctrl-C or SIGTERM; with
# --remote-stages K the broker also waits for K stages started on other machines with the second form.
# Every link is CurveZMQ: the broker's keypair is --keys DIR, or a throwaway one made for this run; the
# local stages share it, remote stages need their public keys in an --allow folder. Local stages only:
# the broker binds loopback. On exit every process started here gets SIGTERM, then SIGKILL after a grace period.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -x "$here/.venv/bin/layerbus" ]]; then
    layerbus="$here/.venv/bin/layerbus"
elif layerbus="$(command -v layerbus)"; then
    :
else
    echo "run_cluster.sh: no layerbus found: expected $here/.venv/bin/layerbus or layerbus on PATH" >&2
    exit 2
fi

usage() {
    sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

if [[ "${1:-}" == "stage" ]]; then
    shift
    exec "$layerbus" -v stage "$@"
fi

stages=3
remote_stages=0
model=""
db=""
log_dir=""
port=5555
keys=""
allow=()
insecure=0
advertise=""
grace_s=10  # SIGTERM, then this long, then SIGKILL
while [[ $# -gt 0 ]]; do
    case "$1" in
        --stages) stages="${2:?--stages needs a number}"; shift 2 ;;
        --remote-stages) remote_stages="${2:?--remote-stages needs a number}"; shift 2 ;;
        --model) model="${2:?--model needs a directory}"; shift 2 ;;
        --db) db="${2:?--db needs a URL}"; shift 2 ;;
        --log-dir) log_dir="${2:?--log-dir needs a directory}"; shift 2 ;;
        --port) port="${2:?--port needs a number}"; shift 2 ;;
        --keys) keys="${2:?--keys needs a directory}"; shift 2 ;;
        --allow) allow+=(--allow "${2:?--allow needs a directory}"); shift 2 ;;
        --insecure) insecure=1; shift ;;
        --advertise) advertise="${2:?--advertise needs a host name}"; shift 2 ;;
        -h|--help) usage ;;
        *) echo "run_cluster.sh: unknown option $1" >&2; usage ;;
    esac
done
for value in "$stages" "$remote_stages" "$port"; do
    [[ "$value" =~ ^[0-9]+$ ]] || { echo "run_cluster.sh: '$value' is not a number" >&2; exit 2; }
done
if (( stages + remote_stages < 1 )); then
    echo "run_cluster.sh: no stages: pass --stages N (local) and/or --remote-stages K" >&2
    exit 2
fi

if [[ -n "$keys" ]] && (( insecure )); then
    echo "run_cluster.sh: --keys and --insecure contradict each other: drop one" >&2
    exit 2
fi
if (( remote_stages > 0 )) && [[ -z "$keys" ]] && (( ! insecure )); then
    echo "run_cluster.sh: remote stages need keys: make the broker's with \`layerbus keys new KEYS --name broker\`," \
         "each stage's on its machine, copy the stages' NAME.key files into a folder and pass" \
         "--keys KEYS --allow FOLDER (docs/operations.md: Security and keys); or --insecure on a network you trust" >&2
    exit 2
fi

home="${LAYERBUS_HOME:-$HOME/.local/share/layerbus}"
log_dir="${log_dir:-$home/logs/cluster-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$log_dir"
cores="$(nproc 2>/dev/null || echo 1)"
threads=$(( stages > 0 ? (cores / stages > 0 ? cores / stages : 1) : 1 ))

pids=()
throwaway_keys=""
stop_all() {
    trap - EXIT INT TERM
    [[ -n "$throwaway_keys" ]] && rm -rf "$throwaway_keys"
    local pid alive deadline
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    deadline=$(( SECONDS + grace_s ))
    while (( SECONDS < deadline )); do
        alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        (( alive )) || break
        sleep 0.2
    done
    for pid in "${pids[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            echo "run_cluster.sh: pid $pid ignored SIGTERM for ${grace_s} s; sending SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    wait 2>/dev/null || true
    echo "run_cluster.sh: stopped (logs in $log_dir)" >&2
}
trap stop_all EXIT
# A Ctrl-C reaches every process of the group at once, so a child may exit (and end `wait -n`)
# before bash runs its trap: the traps only note the signal, and the exit status is chosen after
# the wait, when any pending trap has run.
got_signal=0
trap 'got_signal=130' INT
trap 'got_signal=143' TERM

if (( ! insecure )) && [[ -z "$keys" ]]; then  # local stages only: a keypair for this run, shared with them
    throwaway_keys="$(mktemp -d)"
    "$layerbus" keys new "$throwaway_keys" --name run >/dev/null 2>&1 \
        || { echo "run_cluster.sh: could not make a keypair in $throwaway_keys" >&2; exit 1; }
    keys="$throwaway_keys"
fi
host=127.0.0.1
(( remote_stages > 0 )) && host=0.0.0.0
broker_args=(--stages "$(( stages + remote_stages ))" --bind-control "tcp://$host:$port"
             --bind-results "tcp://$host:$(( port + 1 ))")
stage_keys=()
if [[ -n "$keys" ]]; then
    broker_args+=(--keys "$keys" "${allow[@]}")
    stage_keys=(--keys "$keys" --broker-key "$keys")
else
    broker_args+=(--insecure)
fi
[[ -n "$model" ]] && broker_args+=(--model "$model")
[[ -n "$advertise" ]] && broker_args+=(--advertise "$advertise")
[[ -n "$db" ]] && broker_args+=(--db "$db")
"$layerbus" -v broker "${broker_args[@]}" >"$log_dir/broker.log" 2>&1 &
pids+=($!)
echo "broker pid $! (log $log_dir/broker.log)"
for (( i = 0; i < stages; i++ )); do
    "$layerbus" -v stage --broker "tcp://127.0.0.1:$port" --name "$(hostname)-stage-$i" --threads "$threads" \
        "${stage_keys[@]}" >"$log_dir/stage-$i.log" 2>&1 &
    pids+=($!)
    echo "stage-$i pid $! (log $log_dir/stage-$i.log)"
done
if (( remote_stages > 0 )); then
    key_hint=""
    [[ -n "$keys" ]] && key_hint=" --keys ITS_KEYS --broker-key BROKER.key (a copy of $keys/*.key)"
    echo "waiting for $remote_stages more stage(s): on each machine run" \
         "./run_cluster.sh stage --broker tcp://${advertise:-$(hostname)}:$port --bind tcp://0.0.0.0:PORT" \
         "--advertise tcp://THAT_HOST:PORT$key_hint"
fi
echo "logs in $log_dir; submit jobs with: $layerbus submit INPUT --task ...${db:+ --db $db}; Ctrl-C stops everything"

# Run until any process ends (a crash, or the broker giving up) or a signal arrives (the traps).
status=0
wait -n "${pids[@]}" || status=$?
(( got_signal )) && exit "$got_signal"
echo "run_cluster.sh: a process exited (status $status); stopping the others (see $log_dir)" >&2
exit "$status"

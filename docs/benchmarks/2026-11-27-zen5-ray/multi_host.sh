#!/usr/bin/env bash
# docs/multi_host.md's commands on one machine as two Ray "nodes" (two `ray start`, different ports,
# loopback only), each node 1 CPU: the deployment must put one replica on each. Prints a transcript
# (multi_host_transcript.txt beside this file). Run from the repository root, triforce[ray] installed.
#   bash docs/benchmarks/2026-11-27-zen5-ray/multi_host.sh > docs/benchmarks/2026-11-27-zen5-ray/multi_host_transcript.txt 2>&1
set -uo pipefail
export RAY_DISABLE_USAGE_STATS=1
# Ray 2.60's token authentication: `ray start --head` makes ~/.ray/auth_token; a process that joins by an
# explicit address presents it only with RAY_AUTH_MODE=token (on another host: copy the file there first)
export RAY_AUTH_MODE=token
HEAD_PORT=${HEAD_PORT:-6390}
PORT=${PORT:-8470}
run() { echo "\$ $*"; "$@"; echo "(exit code $?)"; }
server=
cleanup() {
    [ -n "$server" ] && kill -INT "$server" 2>/dev/null && wait "$server"
    echo "\$ ray stop"; ray stop >/dev/null 2>&1; echo "(stopped)"
}
trap cleanup EXIT

# node 1: the head
run ray start --head --node-ip-address 127.0.0.1 --port "$HEAD_PORT" --num-cpus 1 --include-dashboard false \
    --object-store-memory 200000000 --disable-usage-stats
# node 2: on a second host this is `ray start --address HEAD_IP:PORT --num-cpus ...`; on this one it needs
# ports of its own
run ray start --address "127.0.0.1:$HEAD_PORT" --node-ip-address 127.0.0.1 --num-cpus 1 \
    --object-store-memory 200000000 --node-manager-port 6401 --object-manager-port 6402 \
    --min-worker-port 20100 --max-worker-port 20199 --dashboard-agent-listen-port 52401 \
    --dashboard-agent-grpc-port 52402 --metrics-export-port 52403 --runtime-env-agent-port 52404 --disable-usage-stats
run ray status --address "127.0.0.1:$HEAD_PORT"

# the one deploy command
echo "\$ triforce serve --replicas 2 --ray-address 127.0.0.1:$HEAD_PORT --cpus-per-replica 1 --port $PORT --max-context 4096 &"
triforce serve --replicas 2 --ray-address "127.0.0.1:$HEAD_PORT" --cpus-per-replica 1 --port "$PORT" --max-context 4096 \
    --log-level warning > /tmp/multi_host_serve.log 2>&1 &
server=$!
for _ in $(seq 1 90); do curl -sf "localhost:$PORT/health" >/dev/null && break; kill -0 "$server" 2>/dev/null || break; sleep 2; done
run curl -s "localhost:$PORT/health"; echo
run ray status --address "127.0.0.1:$HEAD_PORT"
for prompt in "The sea is" "Once upon a time" "The capital of France is" "def fibonacci(n):"; do
    echo "\$ curl -s localhost:$PORT/v1/completions -d '{\"prompt\": \"$prompt\", \"max_tokens\": 12, \"temperature\": 0}'"
    curl -s "localhost:$PORT/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"prompt\": \"$prompt\", \"max_tokens\": 12, \"temperature\": 0}" |
        python -c 'import json, sys; r = json.load(sys.stdin); t = r["triforce"]
print(json.dumps({"text": r["choices"][0]["text"], "replica": t["replica"], "replica_node": t["replica_node"]}))'
done
echo "\$ kill -INT \$server  # the deployment is deleted; the cluster keeps running until ray stop"
kill -INT "$server"; wait "$server"; echo "(exit code $?)"; server=
echo "--- the server's log (warnings and errors only):"
grep -v "^\s*$" /tmp/multi_host_serve.log | grep -iE "error|warn|triforce:" | grep -v "INFO" | head -20

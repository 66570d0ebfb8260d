#!/usr/bin/env bash
# Several `clawbridge up` processes on one PostgreSQL store behind nginx (docs/scale-out.md).
#
#   DATABASE_URL=postgresql+psycopg://user@127.0.0.1/clawbridge \
#       examples/scale_out/run.sh [N=3] [clawbridge up flags...]
#
# nginx listens on 127.0.0.1:$PORT (default 30000), the proxies on the N ports after it. Each
# proxy keeps its own data directory (run/proxy-K, or under $RUN_DIR); the one holding the
# trainer lease writes adapters and checkpoints there, and the others read the published adapter
# from it, so they share the machine (or a shared filesystem). Ctrl-C stops nginx and every proxy (SIGTERM: each drains).
set -euo pipefail

: "${DATABASE_URL:?set DATABASE_URL to the PostgreSQL store, e.g. postgresql+psycopg://user@127.0.0.1/clawbridge}"
N="${1:-3}"
PORT="${PORT:-30000}"
shift || true
HERE="$(cd "$(dirname "$0")" && pwd)"
RUN="${RUN_DIR:-$PWD/run}"
mkdir -p "$RUN"
: > "$RUN/upstreams.conf"
pids=()
stop() {
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    wait || true
}
trap stop EXIT INT TERM

for k in $(seq 1 "$N"); do
    port=$((PORT + k))
    echo "server 127.0.0.1:$port max_fails=1 fail_timeout=5s;" >> "$RUN/upstreams.conf"
    clawbridge up --db "$DATABASE_URL" --port "$port" --data-dir "$RUN/proxy-$k" "$@" \
        > "$RUN/proxy-$k.log" 2>&1 &
    pids+=($!)
done
for k in $(seq 1 "$N"); do
    until curl -sf "http://127.0.0.1:$((PORT + k))/healthz" > /dev/null; do
        kill -0 "${pids[$((k - 1))]}" 2>/dev/null || { echo "proxy $k exited: see $RUN/proxy-$k.log" >&2; exit 1; }
        sleep 0.5
    done
    echo "proxy $k: pid ${pids[$((k - 1))]}, port $((PORT + k)), $(curl -s "http://127.0.0.1:$((PORT + k))/v1/status" | python3 -c 'import json,sys; print("trainer:", json.load(sys.stdin).get("extra", {}).get("trainer"))')"
done
# the copy's `include upstreams.conf` is read beside it
sed "s/listen 127.0.0.1:30000;/listen 127.0.0.1:$PORT;/" "$HERE/nginx.conf" > "$RUN/nginx.conf"
nginx -p "$RUN" -c "$RUN/nginx.conf" -g 'daemon off;' &
nginx_pid=$!
pids+=("$nginx_pid")
echo "nginx: http://127.0.0.1:$PORT/v1 (round robin over $N proxies)"
wait "$nginx_pid"  # a proxy that dies leaves the others serving: nginx routes around it

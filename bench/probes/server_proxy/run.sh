#!/usr/bin/env bash
# One proxy run at 128 callers (or $LEVELS), 12 s a level, into OUT (default /tmp/server-proxy/TAG):
#   bash bench/probes/server_proxy/run.sh server TAG   # serve.py in its own process, callers over loopback
#   bash bench/probes/server_proxy/run.sh engine TAG   # the same callers in process
# Environment as serve.py and callers.py take it (NO_FREEZE, LOOP, SWITCH, SPARES), plus CKPT (a
# tiny checkpoint, built there if missing) and PORT. Then analyze.py OUT. Under a minute a run.
set -euo pipefail
side=$1; tag=$2
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/server-proxy/$tag}
ckpt=${CKPT:-/tmp/server-proxy/ckpt-tiny}
port=${PORT:-8177}
mkdir -p "$out"
[ -f "$ckpt/model.safetensors" ] || python -m pipecat_qwen_fast.checkpoints.build --size tiny \
    --variant custom_voice --zero-eos --out "$ckpt" >/dev/null
sweep=(--text-mode dual_track --levels "${LEVELS:-128}" --duration 12 --stagger 4 --drain 4
       --warmup 2 --keep-going --out "$out/fleet")
if [ "$side" = server ]; then
    TRACE_OUT=$out/server.json python "$here/serve.py" --model "$ckpt" --device cpu --port "$port" \
        --max-streams 100000 --log-level warning > "$out/serve.log" 2>&1 &
    server=$!
    for _ in $(seq 120); do
        curl -s "localhost:$port/ready" | grep -q '"fully_warm":true' && break
        sleep 0.5
    done
    python "$here/cpu_sample.py" "$server" "$out/server.json.cpu" &
    TRACE_OUT=$out/callers.json python "$here/callers.py" --server-url "http://127.0.0.1:$port" ${EXTRA:-} \
        "${sweep[@]}" > "$out/callers.log" 2>&1
    kill -TERM "$server"
    wait "$server" || true
else
    TRACE_OUT=$out/callers.json python "$here/callers.py" --model "$ckpt" --device cpu \
        --no-round-timing ${EXTRA:-} "${sweep[@]}" > "$out/callers.log" 2>&1 &
    callers=$!
    python "$here/cpu_sample.py" "$callers" "$out/callers.json.cpu" &
    wait "$callers"
fi
sleep 0.5
grep "closed callers" "$out/callers.log"
python "$here/analyze.py" "$out"

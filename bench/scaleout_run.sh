#!/usr/bin/env bash
# Issue 38 on a machine of two or more GPUs: `qwen-fast-tts bench scaleout` (Ray Serve, one replica
# then one per GPU, a replica killed mid-level), as one run that outlives a device call:
#   run(command="BENCH_COMMIT=<short HEAD> bash bench/scaleout_run.sh", kind="nvidia-h200-x2",
#       carry=[".whl", ".ray"], timeout_s=600)      # installs, starts the run, follows it
#   run(command="bash bench/scaleout_run.sh")      # within 30 s of the last: follows it on
# The first call builds the random 0.6B checkpoint and starts the benchmark in a session of its
# own (it runs on until the machine goes back); every call follows its log until it ends or
# FOLLOW_S (default 560) pass, and the call that sees it end packs its results into
# $OUT/results.tgz. Its files live in .scaleout/ (ignored by git), which a warm machine keeps.
# Needs .whl (WHEELS=server scripts/device_wheels.sh) and .ray (scripts/device_ray.sh) carried in
# the first call. SCALEOUT_ARGS adds arguments (e.g. "--one-levels 400,440 --many-levels 800,880").
set -u
t0=$(date +%s)
out=${OUT:-/tmp/device-out}
run=$PWD/.scaleout
mkdir -p "$out" "$run"
export PYTHONPATH=/tmp/site
if [ ! -f "$run/started" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl .ray/*.whl || exit 1
    tar xJf .ray/ray-trim.tar.xz -C /tmp/site || exit 1
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONPATH="$PWD:$PWD/livekit_plugin:/tmp/site" \
        QWEN_FAST_CACHE=$PWD/.devcache/engine
    BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
    tree=$(idx=$(mktemp) && GIT_INDEX_FILE=$idx git read-tree HEAD 2>/dev/null \
           && GIT_INDEX_FILE=$idx git add -A . 2>/dev/null && GIT_INDEX_FILE=$idx git write-tree 2>/dev/null; rm -f "$idx")
    ck=$PWD/.ckpt/qwen-fast-ck-0.6b-cv
    {
        echo "== $(date -u '+%F %T UTC') commit $BENCH_COMMIT (tracked files: tree ${tree:-unknown})"
        nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
        python3 -c "import ray; print('ray', ray.__version__)"
        [ -f "$ck/model.safetensors" ] || python3 -m pipecat_qwen_fast.checkpoints.build --size 0.6b \
            --variant custom_voice --zero-eos --out "$ck"
    } > "$run/setup.log" 2>&1
    cat "$run/setup.log"
    touch "$run/started"
    setsid nohup bash -c "python3 -m pipecat_qwen_fast.cli bench scaleout --model '$ck' --out '$run/out' \
        --commit '$BENCH_COMMIT' ${SCALEOUT_ARGS:-}; echo \$? > '$run/exit'" > "$run/run.log" 2>&1 < /dev/null &
fi
# Follow: the benchmark's own lines (not Ray's) as they come.
seen=0
while [ ! -f "$run/exit" ] && [ $(( $(date +%s) - t0 )) -lt "${FOLLOW_S:-560}" ]; do
    sleep 5
    n=$(wc -l < "$run/run.log")
    [ "$n" -gt "$seen" ] && sed -n "$((seen + 1)),${n}p" "$run/run.log" | grep -E '^\[bench|Error|error' | cut -c1-300
    seen=$n
done
if [ -f "$run/exit" ]; then
    echo "== the run ended: exit $(cat "$run/exit")"
    cp "$run/setup.log" "$run/run.log" "$run/out/" 2>/dev/null
    (cd "$run" && tar czf "$out/results.tgz" out) && ls -l "$out/results.tgz"
    cat "$run/out/scaleout.md" 2>/dev/null
else
    echo "== still running after $(( $(date +%s) - t0 )) s: call again within 30 s"
    tail -c 2000 "$run/out/scaleout.json" 2>/dev/null
fi

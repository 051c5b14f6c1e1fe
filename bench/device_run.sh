#!/usr/bin/env bash
# Several measurements in ONE device call, on one machine that loads each thing once:
#   run(command="bash bench/device_run.sh ckpt startup fleet", kind="nvidia-h200", timeout_s=600)
# Steps, in the order given:
#   ckpt        build the random 0.6B (CKPT_SIZE=1.7b: 1.7B) CustomVoice checkpoint (EOS row zeroed)
#               unless it exists
#   startup     qwen-fast-tts bench startup: cold, warm (and prepared) starts, phases timed
#   fleet       qwen-fast-tts bench fleet, closed loop, with what is left of DEVICE_SECONDS
#   fleet2      the same again on a fresh engine with FLEET2_ENV set (an A/B of an engine setting)
#   fleet-open  the same, open loop
#   fleet-server-proc  the fleet against a server in its own process, then in process (issue 37)
#   fleet-server-procs  the fleet against a server in its own process, the callers split over
#                 CALLER_PROCS processes (default 4), so that no one client loop holds up delivery
#                 (issue 37; each level also gives the server's and each caller process's loop lag)
#   fleet-server-switch  the fleet through one server at each GIL switch interval in SWITCHES
#   fleet-server  the fleet in process and through the server on loopback, level by level on one
#                 engine, dual-track, levels 32-128 at 15 s (issue 37's 10 % bar: comparison.md)
#   server-latency  first audio through the server (WebSocket, HTTP) against in-process
#   streaming-text  the LLM-token benchmark (issue 35): the engine alone, then Pipecat and LiveKit
#               where they import (their wheels carried in .whl/; bench/device_stubs stands in for
#               two packages LiveKit imports and the benchmark never uses, too big to carry)
#   voice-clone     random 0.6B Base and CustomVoice checkpoints: voice creation, cloned first
#                   audio, and the frame time of ICL and x-vector voices against CustomVoice's
#   prefill-modes  the megakernel's fp32 prefill against bf16 and an fp32 weight copy, one engine
#               (bench/probes/prefill_modes.py: GPU ms per bucket, warm TTFC, memory, error)
#   open-profile  an open on the batch path by phase beside 32 live calls (bench/probes/open_profile.py)
#   row-prefill   a round's 1-4 opens with and without the captured prefill of several rows, one
#               engine (bench/probes/row_prefill_ab.py)
#   batch-overlap  a round's vocoder call on a second stream beside the batched decode, against
#               one after the other (bench/probes/batch_overlap.py)
#   round-probes  batch-overlap and row-prefill on one engine, loaded once (bench/probes/round_probes.py)
#   vocoder-pool  a batched vocoder call over pooled streams against copying their states: host and
#               GPU time per call, bit-equality; the vocoder alone, no engine (bench/probes/vocoder_pool_ab.py)
#   overlap-pool  eight greedy calls opened together, serial and overlapped vocoder, pooled states and
#               not: where the audio parts (bench/probes/overlap_pool_check.py)
#   draw-ab       a round's sampling draws: each session's generator against the counter-based
#               draw, host and GPU time per round, no engine (bench/probes/draw_ab.py; seconds)
#   paged-attn    the paged decode-attention kernel against its reference, timed and checked, no engine
#               (bench/probes/paged_attention_ab.py; seconds)
#   gputests    the test files of the GPU paths (GPU_TESTS), junit XML
#   cache-out   the engine cache ($QWEN_FAST_CACHE: megakernel library, inductor and Triton),
#               xz-compressed in parts of 15 MiB ($OUT/cache.txz.part-aa, -ab, ...; at most 5, the
#               sizes by file type in the log); copy the parts into .devcache/ and carry it (with
#               WHEELS=server scripts/device_wheels.sh: the wheels fit beside it) and the next
#               call's first load starts warm (a cold one costs ~4 minutes of the call). 2026-11-28:
#               114 MB as gzip, over what comes back, so not yet used
#   pack        every result folder under $OUT into $OUT/results.tgz (only 8 files come back)
# DEVICE_SECONDS (default 570) bounds the whole call from its start; STARTUP_RUNS picks the starts
# (default cold,warm); SERVE_ARGS adds arguments to `serve` (e.g. --no-engine-process); INPROC_ARGS to
# fleet-server-proc's in-process half (e.g. --in-process-turns streamed); FLEET_BUDGET caps the fleet step's seconds (to leave fleet2 its share); FLEET_ARGS adds arguments to the fleet runs; STREAMING_ARGS to the
# streaming-text run (default --runs 8). Everything lands in $OUT.
# An engine switch's A/B in one call: FLEET2_ENV="QWEN_FAST_OVERLAP_VOCODER=1" (or FLEET2_ARGS="--min-slack-ms 10",
# "--max-round-ms 45"; a server's admission: SERVE_ARGS="--max-round-ms 45")
# with steps fleet fleet2. A/Bs on one engine, loaded once, level by level (step fleet alone):
# FLEET_ARGS="... --chunk-frames 2 --chunk-growth 2 --schedule-ab" (the chunk schedule) or
# FLEET_ARGS="... --text-mode dual_track --in-process-turns both" (whole texts against streamed turns).
# To measure main's HEAD while others have uncommitted edits in the tree: here,
# `mkdir -p .devpatch && git diff HEAD > .devpatch/wt.patch`, and carry ".devpatch" (and ".whl",
# from scripts/device_wheels.sh): the edits are taken back out of the device's copy first.
# What travels is at most 64 MiB: the tracked files are ~30 MiB (2026-11-28) and all the wheels
# 37 MiB, so for the fleet and the server carry the server's wheels alone
# (WHEELS=server scripts/device_wheels.sh; session 36 carried 8.8 MiB: every wheel but pipecat-ai,
# livekit, livekit-agents and openai); the streaming-text step needs the rest.
set -u
t0=$(date +%s)
out=${OUT:-/tmp/device-out}
mkdir -p "$out"
if [ -s .devpatch/wt.patch ]; then
    git apply -R .devpatch/wt.patch && echo "uncommitted edits taken out: main's HEAD runs" \
        || { echo "the edits in .devpatch/wt.patch did not come out cleanly; stopping"; exit 1; }
fi
# Wheels the image lacks (server, audio I/O, pytest-asyncio), carried in .whl/ where present.
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONPATH="$PWD:$PWD/livekit_plugin${PYTHONPATH:+:$PYTHONPATH}"
# The device copy's .git can be the one of the session's first call while its files are the tree
# sent now (session 35: calls labelled a1162cf ran 637f7a4's files). So the label says so when the
# tracked files differ from that HEAD, and the tree that ran is hashed: compare it here with
# `git rev-parse COMMIT^{tree}`, or pass BENCH_COMMIT=COMMIT in the command.
if [ -z "${BENCH_COMMIT:-}" ]; then
    BENCH_COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
    git diff --quiet HEAD -- 2>/dev/null || BENCH_COMMIT="$BENCH_COMMIT+edits"
fi
export BENCH_COMMIT
# STACKS=1: every process that runs an EngineService samples its threads' stacks into $OUT/stacks/
# (pipecat_qwen_fast/engine/stack_samples.py: where the one GIL's seconds go under load).
if [ -n "${STACKS:-}" ]; then export QWEN_FAST_STACK_SAMPLES="$out/stacks"; fi
tree=$(idx=$(mktemp) && GIT_INDEX_FILE=$idx git read-tree HEAD 2>/dev/null \
       && GIT_INDEX_FILE=$idx git add -A . 2>/dev/null && GIT_INDEX_FILE=$idx git write-tree 2>/dev/null; rm -f "$idx")
# The checkpoint and the engine cache live in ignored folders of the device's copy, which a warm
# machine keeps between calls: a call that follows within its idle window loads warm (~100 s, not
# ~300) without carrying anything.
# CKPT_SIZE=1.7b: every step on the random 1.7B CustomVoice instead (issue 34 asks its capacity).
size=${CKPT_SIZE:-0.6b}
ck=$PWD/.ckpt/qwen-fast-ck-$size-cv
export QWEN_FAST_CACHE=${QWEN_FAST_CACHE:-$PWD/.devcache/engine}
[ -d "$QWEN_FAST_CACHE" ] && echo "engine cache kept from an earlier call: $(du -sh "$QWEN_FAST_CACHE" | cut -f1)"
if ls .devcache/cache.txz.part-* >/dev/null 2>&1; then
    mkdir -p "$QWEN_FAST_CACHE" && cat .devcache/cache.txz.part-* | xz -d | tar x -C "$QWEN_FAST_CACHE" \
        && echo "engine cache from .devcache: $(du -sh "$QWEN_FAST_CACHE" | cut -f1)"
fi
left() { echo $(( ${DEVICE_SECONDS:-570} - ($(date +%s) - t0) )); }
# Until the server on port 8177 is ready and its batch path's background warm-up is done (as bench
# fleet waits in process), at most 8 minutes.
wait_warm() {
    python3 - <<'PY'
import json, time, urllib.request
for _ in range(480):
    try:
        if json.load(urllib.request.urlopen("http://127.0.0.1:8177/ready", timeout=2)).get("fully_warm"):
            break
    except Exception:
        pass
    time.sleep(1)
PY
}
{
    echo "== $(date -u '+%F %T UTC') commit $BENCH_COMMIT (tracked files: tree ${tree:-unknown}) steps: $*"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    # Every process's CPU share every 5 s, and the CPU topology (cpu/cpu.jsonl; bench/probes/cpu_watch.py).
    mkdir -p "$out/cpu"
    python3 bench/probes/cpu_watch.py --out "$out/cpu/cpu.jsonl" &
    cwpid=$!
    for step in "$@"; do
        echo "== step $step at $(( $(date +%s) - t0 )) s, $(left) s left"
        case $step in
            ckpt) [ -f "$ck/model.safetensors" ] || python3 -m pipecat_qwen_fast.checkpoints.build --size "$size" \
                      --variant custom_voice --zero-eos --out "$ck" ;;
            startup) python3 -m pipecat_qwen_fast.cli bench startup --model "$ck" --out "$out/startup" \
                         --runs "${STARTUP_RUNS:-cold,warm}" --timeout "$(left)" ;;
            fleet) fb=$(( $(left) - 10 )); [ "${FLEET_BUDGET:-$fb}" -lt "$fb" ] && fb=$FLEET_BUDGET
                   python3 -m pipecat_qwen_fast.cli bench fleet --model "$ck" --out "$out/fleet" \
                       --budget "$fb" ${FLEET_ARGS:-} ;;
            fleet2) # the same sweep again on a fresh engine, with FLEET2_ENV (VAR=value ...) set and
                    # FLEET2_ARGS added (e.g. --min-slack-ms 10): an A/B in one call
                    env ${FLEET2_ENV:-} python3 -m pipecat_qwen_fast.cli bench fleet --model "$ck" --out "$out/fleet2" \
                        --budget "$(( $(left) - 10 ))" ${FLEET_ARGS:-} ${FLEET2_ARGS:-} ;;
            fleet-server) # issue 37's comparison: one engine, each level in process then through the
                          # server, dual-track (a server turn is then one engine stream); every level
                          # run on both sides; FLEET_ARGS (e.g. --levels) overrides
                          python3 -m pipecat_qwen_fast.cli bench fleet --model "$ck" --out "$out/fleet-server" \
                              --through both --text-mode dual_track --levels 32,48,64,80,96,128 --duration 15 \
                              --drain 8 --keep-going --budget "$(( $(left) - 10 ))" ${FLEET_ARGS:-} ;;
            fleet-server-switch) # issue 37: one server in its own process, the fleet through it with
                          # the GIL switch interval at each of SWITCHES (seconds; default 0.005 then
                          # 0.0005), set while it runs (bench/probes/switch_serve.py); FLEET_ARGS as above
                          python3 bench/probes/switch_serve.py --model "$ck" --port 8177 --max-streams 100000 \
                              > "$out/serve.log" 2>&1 &
                          spid=$!
                          wait_warm
                          sws=(${SWITCHES:-0.005 0.0005})
                          each=$(( ($(left) - 15) / ${#sws[@]} ))
                          for sw in "${sws[@]}"; do
                              echo "$sw" > /tmp/qwen-fast-switch; sleep 1.5
                              python3 -m pipecat_qwen_fast.cli bench fleet --server-url http://127.0.0.1:8177 \
                                  --text-mode dual_track --out "$out/fleet-switch-$sw" --budget "$each" ${FLEET_ARGS:-}
                          done
                          kill -TERM $spid; wait $spid ;;
            fleet-server-proc) # issue 37 as deployed: the server in a process of its own (no caller
                          # shares its interpreter), callers over loopback (in CALLER_PROCS
                          # processes, default 1); then the same sweep in process, its engine
                          # loading from the server's cache (~100 s, not ~300). Both dual-track (a
                          # server turn is one engine stream). SERVER_BUDGET: the server half's
                          # seconds after the server is warm (default half of what is left).
                          python3 -m pipecat_qwen_fast.cli serve --model "$ck" --port 8177 --max-streams 100000 ${SERVE_ARGS:-} \
                              > "$out/serve.log" 2>&1 &
                          spid=$!
                          wait_warm
                          half=$(( ($(left) - 30) / 2 ))
                          python3 -m pipecat_qwen_fast.cli bench fleet --server-url http://127.0.0.1:8177 \
                              --text-mode dual_track --caller-processes "${CALLER_PROCS:-1}" \
                              --out "$out/fleet-server-proc" --budget "${SERVER_BUDGET:-$half}" ${FLEET_ARGS:-}
                          kill -TERM $spid; wait $spid
                          python3 -m pipecat_qwen_fast.cli bench fleet --model "$ck" --text-mode dual_track \
                              --out "$out/fleet-engine-proc" --budget "$(( $(left) - 10 ))" ${FLEET_ARGS:-} \
                              ${INPROC_ARGS:-} ;;  # e.g. --in-process-turns streamed: the server's engine path
            fleet-server-procs) # issue 37: as fleet-server-proc's first half, the callers split over
                          # CALLER_PROCS processes (a fleet is many agent processes, not one loop)
                          python3 -m pipecat_qwen_fast.cli serve --model "$ck" --port 8177 --max-streams 100000 ${SERVE_ARGS:-} \
                              > "$out/serve-procs.log" 2>&1 &
                          spid=$!
                          wait_warm
                          python3 -m pipecat_qwen_fast.cli bench fleet --server-url http://127.0.0.1:8177 \
                              --text-mode dual_track --caller-processes "${CALLER_PROCS:-4}" \
                              --out "$out/fleet-server-procs" --budget "$(( $(left) - 20 ))" ${FLEET_ARGS:-}
                          kill -TERM $spid; wait $spid ;;
            fleet-open) python3 -m pipecat_qwen_fast.cli bench fleet --model "$ck" --out "$out/fleet-open" \
                            --mode open --budget "$(( $(left) - 10 ))" ${FLEET_ARGS:-} ;;
            server-latency) python3 -m pipecat_qwen_fast.cli bench server-latency --model "$ck" --out "$out/server" \
                                ${LATENCY_ARGS:-} ;;  # LATENCY_ARGS=--engine-process: the server's engine in a child
            prefill-modes) timeout -s INT "$(( $(left) - 5 ))" python3 bench/probes/prefill_modes.py \
                               --out "$out/prefill_modes" ;;
            open-profile) timeout -s INT "$(( $(left) - 5 ))" python3 bench/probes/open_profile.py \
                              --model "$ck" --out "$out/open-profile" ;;
            row-prefill) timeout -s INT "$(( $(left) - 5 ))" python3 bench/probes/row_prefill_ab.py \
                             --model "$ck" --out "$out/row-prefill" ;;
            batch-overlap) timeout -s INT "$(( $(left) - 5 ))" python3 bench/probes/batch_overlap.py \
                               --model "$ck" --out "$out/batch-overlap" ;;
            round-probes) timeout -s INT "$(( $(left) - 5 ))" python3 bench/probes/round_probes.py \
                              --model "$ck" --out "$out" ;;
            vocoder-pool) mkdir -p "$out/vocoder-pool" && timeout -s INT "$(( $(left) - 5 ))" \
                              python3 bench/probes/vocoder_pool_ab.py --json "$out/vocoder-pool/vocoder_pool_ab.json" \
                              --commit "$BENCH_COMMIT" ;;
            overlap-pool) mkdir -p "$out/overlap-pool" && timeout -s INT "$(( $(left) - 5 ))" \
                              python3 bench/probes/overlap_pool_check.py --json "$out/overlap-pool/overlap_pool.json" \
                              --commit "$BENCH_COMMIT" ;;
            draw-ab) mkdir -p "$out/draw-ab" && timeout -s INT "$(( $(left) - 5 ))" \
                         python3 bench/probes/draw_ab.py --json "$out/draw-ab/draw_ab.json" --commit "$BENCH_COMMIT" ;;
            paged-attn) timeout -s INT "$(( $(left) - 5 ))" python3 bench/probes/paged_attention_ab.py \
                            --out "$out/paged-attn" ;;
            streaming-text) # Stand-ins for two packages LiveKit imports and never uses here (too big to
                            # carry; bench/device_stubs/README.md), each only where it is missing.
                            st="$PYTHONPATH"
                            python3 -c 'import av' 2>/dev/null || st="$st:$PWD/bench/device_stubs/av"
                            python3 -c 'import livekit.local_inference' 2>/dev/null \
                                || st="$st:$PWD/bench/device_stubs/local_inference"
                            st="$st:$PWD/bench/device_stubs/common"  # what the stand-ins share
                            # The frameworks that import (else why not, and the engine alone).
                            fw=engine
                            for f in pipecat livekit; do
                                case $f in
                                    pipecat) imp='import pipecat.pipeline.worker, pipecat.workers.runner
from pipecat_qwen_fast import QwenFastTTSService' ;;
                                    livekit) imp='from livekit import rtc
from livekit.agents.voice import Agent, AgentSession, io
from livekit.plugins import qwen_fast' ;;
                                esac
                                if why=$(PYTHONPATH="$st" python3 -c "$imp" 2>&1); then fw="$fw,$f"
                                else echo "$f not importable: $(echo "$why" | tail -1)"; fi
                            done
                            echo "frameworks: $fw"
                            PYTHONPATH="$st" timeout -s INT "$(( $(left) - 5 ))" python3 -m pipecat_qwen_fast.cli \
                                bench streaming-text --model "$ck" --frameworks "$fw" --out "$out/streaming" \
                                ${STREAMING_ARGS:---runs 8} ;;
            voice-clone) [ -f "$ck-base/model.safetensors" ] || python3 -m pipecat_qwen_fast.checkpoints.build \
                             --size "$size" --variant base --zero-eos --out "$ck-base"
                         [ -f "$ck/model.safetensors" ] || python3 -m pipecat_qwen_fast.checkpoints.build \
                             --size "$size" --variant custom_voice --zero-eos --out "$ck"
                         python3 -m pipecat_qwen_fast.cli bench voice-clone --model "$ck-base" \
                             --custom-voice-model "$ck" --device cuda --seconds 10 --repeats 20 \
                             --frames 160 --frame-repeats 5 --out "$out/voice_clone.json" ;;
            # The test files that exercise the GPU paths (GPU_TESTS to change them); the machine's
            # image has no pipecat or livekit, so the framework tests stay on the CPU. One process
            # (-o addopts=: the image has no pytest-xdist, and one GPU is not shared by two workers).
            gputests) timeout -s INT "$(( $(left) - 10 ))" python3 -m pytest -q -rs -o addopts= -p no:cacheprovider \
                          --junitxml "$out/gputests.xml" ${GPU_TESTS:-tests/test_megakernel.py \
                          tests/test_vocoder_graphs.py tests/test_prefill_graphs.py tests/test_graph_backend.py \
                          tests/test_hybrid_backend.py tests/test_startup.py tests/test_fleet_gpu.py \
                          tests/test_text_gpu.py tests/test_voice_clone_gpu.py tests/test_megakernel_prefill.py \
                          tests/test_host_copy.py} ;;
            cache-out) echo "engine cache by file type (KiB):"
                       find "$QWEN_FAST_CACHE" -type f -printf '%s %f\n' | awk '{n=split($2,p,"."); e=(n>1)?p[n]:"-";
                           s[e]+=$1} END {for (e in s) printf "%10d %s\n", s[e]/1024, e}' | sort -rn | head -15
                       tar cf - -C "$QWEN_FAST_CACHE" . | xz -T0 -6 | split -b 15M -a 2 - "$out/cache.txz.part-"
                       ls -l "$out"/cache.txz.part-* ;;
            pack) kill $cwpid 2>/dev/null; wait $cwpid 2>/dev/null
                  (cd "$out" && find . -mindepth 1 -maxdepth 1 -type d -printf '%P\n' \
                       | tar czf results.tgz -T - --remove-files) && ls -l "$out/results.tgz" ;;
            *) echo "unknown step $step" ;;
        esac
        echo "== step $step exit $? at $(( $(date +%s) - t0 )) s"
    done
    kill $cwpid 2>/dev/null
} 2>&1 | tee "$out/device.log"

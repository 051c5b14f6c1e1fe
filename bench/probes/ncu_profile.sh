#!/usr/bin/env bash
# Nsight Compute profile of the frame megakernel in ONE device call: warp-state sampling per SASS
# instruction (which phase's code the warps wait in, and for what), scheduler and instruction
# statistics, for one whole frame, one talker step and one predictor frame (bench/probes/ncu_profile.py)
# at talker position 100. Writes to $OUT: ncu.log, the report (~33 MB: too large to come back from
# the device), gzipped CSV exports
# (details, raw metrics, the source page as SASS) and the nvdisasm -g -gi listing of the profiled
# library (listing.sass.gz). Then, here: python bench/probes/ncu_summary.py DIR --sass-listing DIR/listing.sass.gz
#
#   run(command="BENCH_COMMIT=<commit> bash bench/probes/ncu_profile.sh", kind="nvidia-h200", timeout_s=600)
#
# Write the commit out: `git rev-parse` there reads the device's copy of .git, which can be the
# session's first commit (2026-11-24: every label read d9ef144).
#
# Extra arguments go to bench/probes/ncu_profile.py (e.g. --sampling, --size 1.7b).
# The clocks stay as found (--clock-control none): the device notes forbid changing them.
set -u
out=${OUT:-/tmp/ncu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
{
    echo "== $(date -u '+%F %T UTC') commit ${BENCH_COMMIT:-unknown} defines '${QWEN_FAST_MK_DEFINES:-}'"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
    echo "ncu: $NCU ($("$NCU" --version | tail -1))"
    # Build outside the profiler first, so ncu sees a warm cache.
    lib=$(python3 -m pipecat_qwen_fast.backends.megakernel build | tail -1) && [ -f "$lib" ] || exit 1
    "$NCU" --profile-from-start off --target-processes all -k regex:qmk_frame_kernel -c 3 \
        --clock-control none --import-source yes \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --section SourceCounters \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        -o "$out/mk" -f python3 bench/probes/ncu_profile.py "$@"
    rep="$out/mk.ncu-rep"
    ls -la "$rep" || exit 1
    "$NCU" -i "$rep" --page details --csv > "$out/details.csv" 2> "$out/export.err" || echo "details export failed"
    "$NCU" -i "$rep" --page raw --csv > "$out/raw.csv" 2>> "$out/export.err" || echo "raw export failed"
    "$NCU" -i "$rep" --page source --csv --print-source sass > "$out/sass.csv" 2>> "$out/export.err" \
        || echo "sass export failed"
    # The line map for bench/probes/ncu_summary.py: the profiled library's sm_90a code with its inline
    # stacks (the CSV has no source lines per instruction; `--print-source cuda` has no metrics).
    (cd /tmp && rm -f ./*.cubin && cuobjdump -xelf all "$lib" > /dev/null && \
        nvdisasm -g -gi -c ./*sm_90a.cubin | gzip > "$out/listing.sass.gz") || echo "listing failed"
    cat "$out/export.err"
    wc -c "$out"/*.csv
    gzip -f "$out"/*.csv
    "$NCU" -i "$rep" --page details --print-units base 2>/dev/null | grep -E -i \
        'qmk_frame|Duration|Warp Cycles Per Issued|Issued Ipc|No Eligible|Stall|Registers|Shared Memory Config' | head -80
} 2>&1 | tee "$out/ncu.log"

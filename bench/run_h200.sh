#!/usr/bin/env bash
# The whole H200 benchmark in ONE device call (run with timeout_s=600): install the carried
# baseline wheels, build the random 0.6B CustomVoice checkpoint (EOS row zeroed), measure our
# engine (each backend) and both baselines, write results.json, results.md and bench.log to $OUT.
#
#   run(command="BENCH_COMMIT=$(git rev-parse --short=12 HEAD) bash bench/run_h200.sh",
#       kind="nvidia-h200", carry=[".whl"], timeout_s=600)
#
# Extra arguments go to `python -m pipecat_qwen_fast.bench.main` (e.g. --quick, --baselines none).
# BENCH_SECONDS (default 560) is when everything must be written, counted from the start of this
# script; each phase gets a share of what is left and writes partial JSON if it is stopped.
set -u
t0=$(date +%s)
out=${OUT:-/tmp/bench-out}
mkdir -p "$out"
site=/tmp/bench-site
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error
{
    echo "== $(date -u '+%F %T UTC') commit ${BENCH_COMMIT:-unknown}"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
    if ls .whl/*.whl >/dev/null 2>&1; then
        # The baselines' wheels go to their own folder, on the path of the baseline processes only:
        # our engine runs on the machine's packages as they are.
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" .whl/*.whl || echo "wheel install failed: the baselines will report import errors"
    else
        echo "no .whl/ carried: the baselines will report import errors"
    fi
    python3 -m pipecat_qwen_fast.bench.main --build-size 0.6b --variant custom_voice \
        --checkpoint-dir /tmp/bench-ckpt --out "$out" --work-dir /tmp/bench-work \
        --baseline-pythonpath "$site" --deadline $((t0 + ${BENCH_SECONDS:-560})) "$@"
    echo "== done after $(($(date +%s) - t0)) s"
} 2>&1 | tee "$out/bench.log"

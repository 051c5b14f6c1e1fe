#!/usr/bin/env bash
# Second set-up step for running the test suite (after `pip install torch==2.13.0 -e ".[test]"`):
#   1. the official qwen-tts in its own cached venv (.cache/oracle-venv): the oracle tests compare
#      our codes and audio with it;
#   2. system packages the demo-agent tests need (chromium, libportaudio2, iproute2), via apt-get;
#   3. Triton in a folder of its own (.cache/triton-interp), for its interpreter only: the
#      paged-attention kernels' CPU check runs them there in a subprocess
#      (tests/test_paged_attention_probe.py); the CPU build of torch ships no Triton, and the rest
#      of the suite keeps running without it.
# Every step is idempotent and fast when already done.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/tests/oracle/setup_env.sh"
bash "$root/.ci/install_system_deps.sh"
triton_dir="$root/.cache/triton-interp"
if [ ! -d "$triton_dir/triton" ]; then
    python3 -m pip install -q --no-deps --target "$triton_dir" "triton==3.9.0"
fi

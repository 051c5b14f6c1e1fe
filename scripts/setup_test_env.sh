#!/usr/bin/env bash
# Second set-up step for running the test suite (after `pip install torch==2.13.0 -e ".[test]"`):
#   1. the official qwen-tts in its own cached venv (.cache/oracle-venv): the oracle tests compare
#      our codes and audio with it;
#   2. system packages the demo-agent tests need (chromium, libportaudio2, iproute2), via apt-get.
# Both steps are idempotent and fast when already done.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/tests/oracle/setup_env.sh"
bash "$root/.ci/install_system_deps.sh"

#!/usr/bin/env bash
# Creates the oracle venv (official qwen-tts 0.1.1 + transformers 4.57.3, reusing the system torch)
# before pytest, so tests/test_oracle.py runs instead of skipping. Cached under .cache/oracle-venv:
# about a minute on a warm pip cache, instant when its stamp is current. Fails CI if it cannot be
# built; run pytest with QWEN_ORACLE_REQUIRED=1 so a missing venv is a failure, not a skip.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec bash "$root/tests/oracle/setup_env.sh"

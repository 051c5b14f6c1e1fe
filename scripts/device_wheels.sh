#!/usr/bin/env bash
# The wheels the GPU machine's image lacks, into .whl/ (ignored by git, carried with carry=[".whl"]):
# the server and its tests (FastAPI, uvicorn, audio I/O, pytest-asyncio) and, for
# `bash bench/device_run.sh streaming-text`, Pipecat and LiveKit (bench/device_stubs/README.md
# lists why each is there and what is left out). Python 3.12, manylinux x86_64, the versions this
# repository's test environment runs. About 38 MB; a fresh checkout has no .whl/, so run it once
# per machine before the first device call that needs them.
set -euo pipefail
cd "$(dirname "$0")/.."
server=(fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 uvicorn==0.54.0 httptools==0.9.0
        websockets==17.4 python-multipart==0.0.34 python-dotenv==1.2.2 watchfiles==1.3.0
        pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
        soundfile==0.13.1 soxr==1.0.0 cffi==2.0.0 pycparser==3.0 pytest-asyncio==1.5.0
        opentelemetry-api==1.45.2)
frameworks=(pipecat-ai==1.14.0 livekit==1.1.21 livekit-agents==1.8.9 livekit-api==1.2.2
            livekit-protocol==1.1.29 livekit-blingfire==1.2.0 openai==3.57.0 sentencex==1.0.32
            protobuf==6.33.6 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
            opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
            opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
            opentelemetry-exporter-http-transport==0.66b2 num2words==0.5.14 loudness==0.2.0
            loguru==0.7.3 httpx2==2.16.2 sniffio==1.3.1 json-repair==0.63.5 pyjwt==2.15.1
            docstring-parser==0.18.0)
# WHEELS=server: the server's alone (~6 MB, room beside a carried engine cache: bench/device_run.sh
# cache-out); a .whl/ kept from before keeps the frameworks' too, so start from an empty one.
selected=("${frameworks[@]}")
[ "${WHEELS:-all}" = server ] && selected=()
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${server[@]}" ${selected[@]+"${selected[@]}"}
du -sh .whl

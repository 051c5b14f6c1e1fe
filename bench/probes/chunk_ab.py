"""Many concurrent streams with one setting against another, on one engine in one call:
`python bench/probes/chunk_ab.py [--streams 16] [--frames 250] [--vary chunk] [--json F] VALUE ...` (e.g. 4 3 4 3).

Random 0.6B CustomVoice checkpoint (EOS row zeroed), the `auto` backend, the benchmark's
concurrency measurement (`bench_engine._run_level`: every stream opened at once through one
EngineService; a stream starves when a player started at its first chunk would run dry). VALUE is
each run's `chunk_frames` (`--vary chunk`: the second chunk; later chunks double from it) or the
`auto` backend's `fast_sessions` (`--vary fast_sessions`: up to how many calls run on the
megakernel before the batch takes them). `--streams` takes a list (e.g. 3,4,5): each value runs at
each stream count in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.bench.engine import _run_level
from pipecat_qwen_fast.checkpoints.build import build_checkpoint
from pipecat_qwen_fast.engine.service import EngineService


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="16")
    ap.add_argument("--frames", type=int, default=250)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--vary", choices=("chunk", "fast_sessions"), default="chunk")
    ap.add_argument("values", type=int, nargs="+")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": os.environ.get("BENCH_COMMIT", "unknown"), "script": "bench/probes/chunk_ab.py",
           "streams": args.streams, "frames": args.frames, "vary": args.vary, "runs": []}
    stream_counts = [int(n) for n in args.streams.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(tmp, "0.6b", "custom_voice", zero_eos=True)
        t0 = time.perf_counter()
        engine = QwenTTSEngine.from_pretrained(tmp, device="cuda", progress=False)
        out["load_s"] = time.perf_counter() - t0
        service = EngineService.for_engine(engine)
        try:
            service.wait_ready_blocking(timeout=60)
            asyncio.run(_run_level(service, engine, 1, 4, timeout=30))  # the service thread's first CUDA work
            for value in args.values:
                chunk = value if args.vary == "chunk" else SynthesisRequest.chunk_frames
                if args.vary == "fast_sessions":
                    engine.backend.fast_sessions = value
                for n in stream_counts:
                    r = asyncio.run(_run_level(service, engine, n, args.frames, timeout=120, chunk_frames=chunk))
                    r[args.vary] = value
                    out["runs"].append(r)
                    print(f"{args.vary} {value}, {n} streams: starved {r['starved_streams']}/{r['streams']}, worst "
                          f"underrun {r['worst_underrun_ms']:.1f} ms, TTFC p50 {r['ttfc_ms']['p50']:.1f} ms, RTF p50 "
                          f"{r['rtf_per_stream']['p50']:.3f}, {r['aggregate_frames_per_s']:.0f} frames/s", flush=True)
                if args.json:
                    args.json.write_text(json.dumps(out, indent=2))
        finally:
            service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bursts of concurrent streams, each level repeated, per backend: how much of a TTFC difference
between backends is run-to-run noise. `python bench/probes/burst_repeat.py --json FILE [--levels 16 16 16 64 64]`
(random 0.6B CustomVoice checkpoint, EOS row zeroed, built under /tmp)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from pipecat_qwen_fast import QwenTTSEngine
from pipecat_qwen_fast.bench.engine import _run_level
from pipecat_qwen_fast.bench.main import build_checkpoint
from pipecat_qwen_fast.bench.texts import CONCURRENCY_FRAMES
from pipecat_qwen_fast.engine.service import EngineService


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--backends", nargs="+", default=["auto", "torch"])
    ap.add_argument("--levels", nargs="+", type=int, default=[16, 16, 16, 64, 64])
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/burst-ckpt"))
    args = ap.parse_args()
    if not (args.checkpoint / "config.json").exists():
        build_checkpoint("0.6b", "custom_voice", args.checkpoint)
    out = {"levels": args.levels, "runs": {}}
    for backend in args.backends:
        t0 = time.perf_counter()
        engine = QwenTTSEngine.from_pretrained(args.checkpoint, backend=backend, progress=False)
        load_s = time.perf_counter() - t0
        # One service (one engine thread) for every burst, as in a server; one unmeasured stream
        # first, as in the benchmark.
        service = EngineService.for_engine(engine)
        results = []
        try:
            service.wait_ready_blocking(timeout=60)
            warm = asyncio.run(_run_level(service, engine, 1, 4, timeout=30))
            for n in args.levels:
                lv = asyncio.run(_run_level(service, engine, n, CONCURRENCY_FRAMES, timeout=60))
                row = {"streams": n, "ttfc_p50_ms": lv["ttfc_ms"]["p50"], "frames_per_s": lv["aggregate_frames_per_s"],
                       "worst_underrun_ms": lv["worst_underrun_ms"], "completed": lv["completed"]}
                print(backend, row, flush=True)
                results.append(row)
        finally:
            service.close()
        out["runs"][backend] = {"load_s": load_s, "warm_stream_ttfc_ms": warm["ttfc_ms"]["p50"], "bursts": results}
        engine.close()
        del engine
    args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

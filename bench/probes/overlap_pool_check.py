"""Does a round's vocoder work on the side stream (overlap_vocoder) give the audio of the same
round run serially, with the vocoder states in the pool and outside it?
`python bench/probes/overlap_pool_check.py --json F`

tests/test_fleet_gpu.py::test_overlapped_vocoder_gives_the_same_chunks failed on the H200
(2026-11-29): equal codes, request 0's chunk at frame 4 differing in 7429 of 7680 samples. Here the
same eight greedy requests, opened together, run on one engine: serial, overlapped, serial again
(the first run may capture vocoder graphs the others reuse), and, where the engine's vocoder
graphs have a pool, serial and overlapped with the pool emptied (every stream then holds its own
state and a call copies it in and out, the path before vocoder/pool.py). Written: the vocoder
graph sizes before and after each run, and for each run against each serial one, per request,
whether the codes and the audio are equal and the first chunk where the audio is not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in range(3)] + [
    str(Path(__file__).resolve().parents[2] / "tests")]
from helpers_service import collect_all, open_together

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.checkpoints.build import build_checkpoint
from pipecat_qwen_fast.engine.service import EngineService


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp()) / "ckpt"
    build_checkpoint(path, "0.6b", "custom_voice", seed=0, zero_eos=True, dtype="bfloat16")
    engine = QwenTTSEngine.from_pretrained(path, device="cuda", backend="torch", progress=False)
    reqs = [SynthesisRequest(f"Caller {i} has something to say.", voice="ryan", seed=i, greedy=True,
                             max_frames=10 + 7 * i) for i in range(8)]

    async def serve(overlap: bool, pooled: bool):
        async with EngineService.for_engine(engine, max_round_ms=None, max_lead_s=None,
                                            overlap_vocoder=overlap) as service:
            await service.wait_ready()  # the pool is made with the vocoder's graphs, at warm-up
            pool = engine.vocoder_graphs.pool
            if pooled or pool is None:  # as the engine is (with no pool, every call copies)
                return await collect_all(open_together(service, reqs), 300)
            held = pool.free[:]
            pool.free.clear()  # no row free: every new stream holds its own state
            try:
                return await collect_all(open_together(service, reqs), 300)
            finally:
                pool.free[:] = held

    # Serial twice, around the overlapped run: the first run may capture vocoder graphs for sizes
    # warm-up did not make (a capture inside a run is a difference between the runs too).
    ways = [("serial", False, True), ("overlapped", True, True), ("serial again", False, True)]
    if_pool = [("serial, pool emptied", False, False), ("overlapped, pool emptied", True, False)]
    runs, entries = {}, {}
    for name, overlap, pooled in ways + if_pool:
        if not pooled and engine.vocoder_graphs.pool is None:
            continue  # nothing to empty
        before = sorted(engine.vocoder_graphs.entries)
        chunks = asyncio.run(serve(overlap, pooled))
        runs[name] = chunks
        entries[name] = {"before": before, "after": sorted(engine.vocoder_graphs.entries)}
        print(f"{name}: vocoder graph sizes {before} -> {entries[name]['after']}; calls pooled "
              f"{engine.vocoder_graphs.calls_pooled}, copied {engine.vocoder_graphs.calls_copied}", flush=True)
    out = {"gpu": torch.cuda.get_device_name(0), "commit": args.commit, "pool": engine.vocoder_graphs.pool is not None,
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "entries": entries, "against": {}}
    for base in ("serial", "serial again"):
        out["against"][base] = {}
        for name, chunks in runs.items():
            if name == base:
                continue
            per = []
            for r, got, want in zip(reqs, chunks, runs[base]):
                codes = all(np.array_equal(a.codes, b.codes) for a, b in zip(got, want))
                first_bad = next((a.frame_index for a, b in zip(got, want) if not np.array_equal(a.pcm, b.pcm)), None)
                worst = max(int(np.abs(a.pcm.astype(np.int32) - b.pcm.astype(np.int32)).max())
                            for a, b in zip(got, want))
                per.append({"request": r.seed, "codes_equal": codes, "first_chunk_differing": first_bad,
                            "max_diff": worst})
            out["against"][base][name] = per
            print(f"{name} against {base}:", [(p["request"], p["first_chunk_differing"], p["max_diff"]) for p in per],
                  flush=True)
    args.json.write_text(json.dumps(out, indent=2))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

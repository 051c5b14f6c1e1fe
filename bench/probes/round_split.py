"""Where a round of many concurrent streams goes: `python bench/probes/round_split.py --out DIR`.

A random 0.6B CustomVoice engine (`backend="auto"`) behind one EngineService, as the benchmark's
concurrency levels run it (`bench_engine._run_level`: every stream opened at once, or one every
`--stagger-ms`). The engine thread's methods are wrapped (host wall time, no sync added), so per
level:

* `_step_round`: the whole round;
* `backend.decode_frames`: the batched frame's launch (host only; the GPU work is waited for in
  the round's one read of the codes, which lies in the round but outside every other stage);
* `_after_frame`, and within it `_flush`: a chunk's bookkeeping (and, before 2026-11-24's batched
  vocoder calls, the chunk's vocoder call, its launch and the wait for its audio);
* `_vocode_round`: the round's flushed chunks, one vocoder call per chunk size and one wait;
* `open_sessions`: prompts and prefills.

Writes `round_split.json` (and a cProfile of the largest level, `round_split_cprofile.txt`).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

# This folder (the other probes), bench/ (megakernel_check, cuda_timing) and the repository.
sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in range(3)]
import megakernel_check as mc
from ttfc_host_profile import timed

from pipecat_qwen_fast.bench.engine import _run_level
from pipecat_qwen_fast.engine.service import EngineService

STAGES = ("_step_round", "_after_frame", "_flush", "_vocode_round", "open_sessions", "backend.decode_frames")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--streams", default="16,64")
    ap.add_argument("--frames", type=int, default=50)
    ap.add_argument("--stagger-ms", type=float, default=0.0,
                    help="open the streams one every this many ms instead of all at once")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure each level this many times on the same engine (levels[n] is the first, "
                         "repeats[n] all of them): the spread between runs of one tree, for A/B calls")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": args.commit,
                    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "frames": args.frames,
                    "levels": {}, "repeats": {}}
    levels = [int(n) for n in args.streams.split(",")]
    stagger = {"stagger_s": args.stagger_ms / 1e3} if args.stagger_ms else {}
    result["stagger_ms"] = args.stagger_ms
    with mc.random_engine(backend="auto") as (engine, load_s):
        result["load_s"] = load_s
        totals: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for name in STAGES:
            owner = engine.backend if name.startswith("backend.") else engine
            attr = name.split(".")[-1]
            if not hasattr(owner, attr):  # an older tree (A/B runs)
                continue
            inner = timed(getattr(owner, attr), name, totals)

            def counted(*a, _inner=inner, _name=name, **kw):
                counts[_name] += 1
                return _inner(*a, **kw)

            setattr(owner, attr, counted)
        service = EngineService.for_engine(engine)
        try:
            service.wait_ready_blocking(timeout=60)
            asyncio.run(_run_level(service, engine, 1, 4, timeout=30))  # the service thread's first CUDA work
            for n in levels:
                asyncio.run(_run_level(service, engine, n, args.frames, timeout=120, **stagger))  # warm this level's shapes
                for rep in range(args.repeat):
                    totals.clear()
                    counts.clear()
                    pr = cProfile.Profile() if n == max(levels) and rep == 0 else None
                    if pr:
                        pr.enable()
                    t0 = time.perf_counter()
                    r = asyncio.run(_run_level(service, engine, n, args.frames, timeout=120, **stagger))
                    wall = time.perf_counter() - t0
                    if pr:
                        pr.disable()
                        s = io.StringIO()
                        st = pstats.Stats(pr, stream=s)
                        st.sort_stats("tottime").print_stats(40)
                        (args.out / "round_split_cprofile.txt").write_text(s.getvalue())
                    ms = {k: round(1e3 * v, 1) for k, v in totals.items()}
                    rounds = counts["_step_round"]
                    split = {
                        "rounds": rounds,
                        "level_wall_ms": round(1e3 * wall, 1),
                        "stage_ms": ms,
                        "calls": dict(counts),
                        "per_round_ms": {k: round(v / max(rounds, 1), 2) for k, v in ms.items()},
                        "round_outside_after_frame_and_launch_ms": round(
                            (ms.get("_step_round", 0) - ms.get("_after_frame", 0) - ms.get("backend.decode_frames", 0))
                            / max(rounds, 1), 2),
                        "aggregate_frames_per_s": r["aggregate_frames_per_s"],
                        "ttfc_p50_ms": r["ttfc_ms"]["p50"],
                        "starved_streams": r["starved_streams"],
                    }
                    result["levels"].setdefault(n, split)
                    result["repeats"].setdefault(n, []).append(split)
                    print(f"{n} streams: {json.dumps(split)}", flush=True)
        finally:
            service.close()
    (args.out / "round_split.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

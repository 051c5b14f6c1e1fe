"""Where the host's part of the time to first audio goes: `python bench/probes/ttfc_host_profile.py --out DIR`.

A random 0.6B CustomVoice engine (`backend="auto"`, the product's default), warmed by
`bench_texts.UTTERANCES`. Then, over the same utterances (bench_engine.measure_ttfc: the call with
text to the first PCM chunk on the host, the rest cancelled):

* `ttfc_host_profile.json`: warm TTFC, and per request the host time of each stage of the call
  (wrapped engine methods; no device sync is added, so a stage's time is its host work plus any
  wait it does itself), summed over the call;
* `ttfc_host_cprofile.txt`: cProfile of 24 calls, by own time and by cumulative time;
* `ttfc_host_trace.json`: a torch.profiler trace (CPU and CUDA) of 3 calls, for chrome://tracing.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

# This folder (the other probes), bench/ (megakernel_check, cuda_timing) and the repository.
sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in range(3)]
import megakernel_check as mc

from pipecat_qwen_fast.bench import engine as bench_engine
from pipecat_qwen_fast.bench import texts
from pipecat_qwen_fast.engine import engine as engine_module

# Engine methods (and backend methods, "backend." prefix) whose host time is summed per call.
STAGES = ("_new_session", "_begin_segment", "_prefill", "_start_vocoder", "step", "cancel",
          "backend.new_state", "backend.prefill_many", "backend.prefill", "backend.decode_frame",
          "backend.release")
# Functions the engine module imported, timed the same way.
MODULE_FUNCTIONS = ("build_prompt", "split_text", "normalize_text")


def timed(fn, name: str, totals: dict[str, float]):
    """`fn` that adds its host time to totals[name]."""
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            totals[name] += time.perf_counter() - t0
    return wrapper


def wrap_stages(engine, totals: dict[str, float]) -> None:
    """Replace each stage by a wrapper that adds its host time to `totals` (instance attributes and
    the engine module's globals, so the engine's own code calls the wrappers)."""
    for name in STAGES:
        owner = engine.backend if name.startswith("backend.") else engine
        attr = name.split(".")[-1]
        fn = getattr(owner, attr, None)
        if fn is not None:
            setattr(owner, attr, timed(fn, name, totals))
    for name in MODULE_FUNCTIONS:
        setattr(engine_module, name, timed(getattr(engine_module, name), name, totals))


def run_calls(engine, n: int, seed0: int) -> list[float]:
    out = []
    for i in range(n):
        text = texts.UTTERANCES[i % len(texts.UTTERANCES)]
        out.append(1e3 * bench_engine.measure_ttfc(engine, text, texts.frames_for(text), seed0 + i))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": args.commit,
                    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "backend": "auto"}
    with mc.random_engine(backend="auto") as (engine, load_s):
        result["load_s"] = load_s
        result["backend_name"] = type(engine.backend).__name__
        run_calls(engine, len(texts.UTTERANCES), 100)  # warm
        result["ttfc_ms"] = bench_engine.summarize(run_calls(engine, len(texts.UTTERANCES), 100))

        totals: dict[str, float] = defaultdict(float)
        wrap_stages(engine, totals)
        per_call: list[dict[str, float]] = []
        ttfc = []
        for i in range(len(texts.UTTERANCES)):
            totals.clear()
            ttfc += run_calls(engine, 1, 200 + i)
            per_call.append({k: 1e3 * v for k, v in totals.items()})
        result["stages_wrapped_ttfc_ms"] = bench_engine.summarize(ttfc)
        result["stage_host_ms_median"] = {k: statistics.median(c.get(k, 0.0) for c in per_call)
                                          for k in sorted({k for c in per_call for k in c})}

        pr = cProfile.Profile()
        pr.enable()
        run_calls(engine, 24, 300)
        pr.disable()
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s)
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumulative").print_stats(60)
        (args.out / "ttfc_host_cprofile.txt").write_text(s.getvalue())

        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(3):
                with torch.profiler.record_function(f"ttfc_call_{i}"):
                    run_calls(engine, 1, 400 + i)
        prof.export_chrome_trace(str(args.out / "ttfc_host_trace.json"))
    (args.out / "ttfc_host_profile.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

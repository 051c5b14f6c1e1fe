"""Where a streamed utterance's GPU time goes between frames: `python bench/probes/stream_timeline.py
--out DIR [--frames N] [--repeats K]`.

Random 0.6B CustomVoice checkpoint, the default backend and chunk schedule, one stream of
`bench_texts.RTF_TEXT` at a time. For each setting of `QwenTTSEngine.ahead_at_chunks` (off, on,
off, on, ...) it times the stream without a profiler (RTF, frames/s after the first chunk) and the
warm TTFC over `bench_texts.UTTERANCES`, then
runs it once more under torch.profiler and splits the GPU timeline at the frame kernels
(`qmk_frame_kernel`): between two frames the GPU runs the codes' copy and, at a chunk's end,
the vocoder's work; whatever is left of that window is the GPU waiting for the host. Writes
`DIR/stream_timeline.json` and the profiler traces (gzipped)."""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: megakernel_check, cuda_timing
from megakernel_check import git_commit, random_engine, warm_ttfc

from pipecat_qwen_fast.bench import engine as bench_engine
from pipecat_qwen_fast.bench import texts
from pipecat_qwen_fast.engine.engine import QwenTTSEngine

FRAME_KERNEL = "qmk_frame_kernel"
VOCODER_WINDOW_US = 100.0  # a window between frames with more GPU work than this holds a vocoder call


def gpu_intervals(trace: dict) -> list[tuple[float, float, bool]]:
    """(start us, end us, is a frame kernel) of every kernel, copy and memset, by start."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        out.append((float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]), FRAME_KERNEL in ev.get("name", "")))
    return sorted(out)


def busy_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def split_windows(iv: list[tuple[float, float, bool]]) -> dict:
    """The stretches between consecutive frame kernels: their length, the GPU work inside, the
    idle rest; those holding a vocoder call apart from the others."""
    frames = [(a, b) for a, b, f in iv if f]
    others = [(a, b) for a, b, f in iv if not f]
    rows = []
    j = 0
    for (a0, b0), (a1, _) in itertools.pairwise(frames):
        while j < len(others) and others[j][1] <= b0:
            j += 1
        inside = []
        k = j
        while k < len(others) and others[k][0] < a1:
            s, e = others[k]
            inside.append((max(s, b0), min(e, a1)))
            k += 1
        work = busy_us([(s, e) for s, e in inside if e > s])
        gaps, end = [], b0  # idle stretches over 20 us: (offset from the frame's end, length)
        for s, e in sorted((s, e) for s, e in inside if e > s):
            if s - end > 20.0:
                gaps.append((round(end - b0, 1), round(s - end, 1)))
            end = max(end, e)
        if a1 - end > 20.0:
            gaps.append((round(end - b0, 1), round(a1 - end, 1)))
        first = min((s for s, e in inside if e > s), default=a1)
        last = max((e for s, e in inside if e > s), default=b0)
        rows.append({"window_us": a1 - b0, "work_us": work, "idle_us": a1 - b0 - work,
                     "before_work_us": first - b0, "after_work_us": a1 - last, "gaps_over_20us": gaps})

    def stats(rs: list[dict]) -> dict:
        if not rs:
            return {"n": 0}
        out = {"n": len(rs)}
        for key in ("window_us", "work_us", "idle_us", "before_work_us", "after_work_us"):
            vals = [r[key] for r in rs]
            out[key] = {"sum": sum(vals), "p50": statistics.median(vals), "max": max(vals)}
        return out

    voc = [r for r in rows if r["work_us"] > VOCODER_WINDOW_US]
    plain = [r for r in rows if r["work_us"] <= VOCODER_WINDOW_US]
    durs = [b - a for a, b in frames]
    span = frames[-1][1] - frames[0][0] if frames else 0.0
    return {
        "frame_kernels": len(frames),
        "frame_kernel_us": {"p50": statistics.median(durs), "sum": sum(durs)} if durs else None,
        "span_first_to_last_frame_us": span,
        "vocoder_windows": stats(voc),
        "other_windows": stats(plain),
        "vocoder_window_rows": voc,
    }


def profiled_stream(engine: QwenTTSEngine, frames: int, seed: int, trace_path: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run = bench_engine.measure_stream(engine, texts.RTF_TEXT, frames, seed)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
        with gzip.open(trace_path, "wt") as f:
            json.dump(trace, f)
    out = split_windows(gpu_intervals(trace))
    out["stream_under_profiler"] = {k: run[k] for k in ("rtf", "frames_per_s_after_first_chunk", "chunk_sizes")}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--frames", type=int, default=texts.RTF_FRAMES)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "commit": args.commit or git_commit(), "script": "bench/probes/stream_timeline.py",
                    "gpu": torch.cuda.get_device_name(), "frames": args.frames, "runs": []}
    with random_engine() as (engine, load_s):
        result["load_s"] = load_s
        result["backend"] = engine.backend.name
        bench_engine.measure_stream(engine, texts.RTF_TEXT, args.frames, 200)  # warm
        for k in range(2 * args.repeats):
            engine.ahead_at_chunks = bool(k % 2)
            run = bench_engine.measure_stream(engine, texts.RTF_TEXT, args.frames, 200)
            row = {"ahead_at_chunks": engine.ahead_at_chunks, "rtf": run["rtf"], "ttfc_ms": run["ttfc_ms"],
                   "frames_per_s_after_first_chunk": run["frames_per_s_after_first_chunk"],
                   "chunk_sizes": run["chunk_sizes"], "ttfc_warm_ms": warm_ttfc(engine)}
            result["runs"].append(row)
            w = row["ttfc_warm_ms"]
            print(f"ahead_at_chunks={row['ahead_at_chunks']}: RTF {row['rtf']:.5f}, TTFC {row['ttfc_ms']:.2f} ms, "
                  f"{row['frames_per_s_after_first_chunk']:.1f} frames/s after the first chunk; warm TTFC p50 "
                  f"{w['p50']:.2f} ms, p95 {w['p95']:.2f} over {w['n']} utterances", flush=True)
        for at in (False, True):
            engine.ahead_at_chunks = at
            name = f"trace_ahead_at_chunks_{int(at)}.json.gz"
            tl = profiled_stream(engine, args.frames, 200, args.out / name)
            tl["trace"] = name
            result[f"timeline_ahead_at_chunks_{int(at)}"] = tl
            v, o = tl["vocoder_windows"], tl["other_windows"]
            print(f"timeline ahead_at_chunks={at}: {tl['frame_kernels']} frames, frame kernel p50 "
                  f"{tl['frame_kernel_us']['p50']:.1f} us; {v['n']} vocoder windows: work "
                  f"{v['work_us']['sum'] / 1e3:.2f} ms, idle {v['idle_us']['sum'] / 1e3:.2f} ms (before the "
                  f"work p50 {v['before_work_us']['p50']:.0f} us, after p50 {v['after_work_us']['p50']:.0f} us); "
                  f"{o['n']} other windows idle {o['idle_us']['sum'] / 1e3:.2f} ms (p50 {o['idle_us']['p50']:.1f} "
                  f"us, max {o['idle_us']['max']:.0f} us)", flush=True)
    (args.out / "stream_timeline.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a captured streaming-vocoder call spends its time: `python bench/probes/vocoder_graph_profile.py`.

Full-size released vocoder config with random weights (bench/probes/vocoder_bench.py's `build`), in the
engine's dtype (bfloat16 by default; the float32 files of 2026-11-22, all but `..._bf16.json`,
were taken before this option), the engine's `GraphedVocoder`, chunk sizes 1 and 4. Prints and writes (--json) per chunk size: the
replay time (CUDA-event median of 50, state copies included, as the engine calls it), the number
of kernels one call runs, the sum of their durations (the rest of the replay is launch gaps), and
the kernels grouped by name with their count and total time: for the plain captured step, and
(unless --no-compile) for the step captured from torch.compile'd code as the engine's warm-up
does it (GraphedVocoder's compile_sizes), with its compile + capture time and the largest
difference from the plain graph's audio over 20 consecutive calls from the same state (and the
plain graph's difference from eager, for scale).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

# This folder (the other probes), bench/ (megakernel_check, cuda_timing) and the repository.
sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in range(3)]
from cuda_timing import event_times_ms  # noqa: E402
from vocoder_bench import build  # noqa: E402

from pipecat_qwen_fast.vocoder.graphs import GraphedVocoder  # noqa: E402
from pipecat_qwen_fast.vocoder.vocoder import Vocoder  # noqa: E402


def time_calls(gv: GraphedVocoder, codes: torch.Tensor, stream, n: int) -> list[float]:
    return event_times_ms(lambda: gv.decode_stream(codes, stream), n, sync_each=True)


def profile_calls(gv: GraphedVocoder, codes: torch.Tensor, stream, n: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            gv.decode_stream(codes, stream)
        torch.cuda.synchronize()
    groups: dict[str, list[float]] = defaultdict(list)
    total_us, count = 0.0, 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            dur = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            groups[ev.name[:90]].append(dur)
            total_us += dur
            count += 1
    rows = sorted(((k, len(v) / n, sum(v) / n) for k, v in groups.items()), key=lambda r: -r[2])
    return {"kernels_per_call": count / n, "kernel_us_per_call": total_us / n,
            "by_name": [{"name": k, "per_call": c, "us_per_call": t} for k, c, t in rows]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--top", type=int, default=25, help="kernel groups printed per variant")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="the vocoder's dtype (the engine runs it in bfloat16 on CUDA)")
    ap.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                    help="conv weights channels-innermost, as the engine stores them on CUDA")
    ap.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                    help="cuDNN times its algorithms for each shape at capture, as the engine's graphs do")
    ap.add_argument("--compile-dynamic", action="store_true",
                    help="one compiled step for every chunk size >= 2 (the frame count symbolic)")
    ap.add_argument("--whole-frames", type=int, default=0,
                    help="also time the eager whole-utterance decode of this many frames")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.backends.cudnn.allow_tf32 = True
    dtype = getattr(torch, args.dtype)
    base = build(None, "cuda")
    voc = Vocoder.from_state_dict(base.cfg, base.state_dict(), device="cuda", dtype=dtype)  # as the engine loads it
    if args.channels_last:
        voc.use_channels_last()
    gv = GraphedVocoder(voc, torch.device("cuda"), dtype, compile_sizes=(), cudnn_benchmark=args.cudnn_benchmark)
    q = voc.cfg.num_quantizers
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "dtype": args.dtype,
           "channels_last": args.channels_last, "cudnn_benchmark": args.cudnn_benchmark,
           "compile_dynamic": args.compile_dynamic}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError as e:
        out["triton"] = f"not importable: {e}"
    if args.whole_frames:
        codes = torch.randint(0, voc.cfg.codebook_size, (1, q, args.whole_frames), device="cuda")
        with torch.no_grad():
            ms = event_times_ms(lambda: voc.decode(codes, check_values=False), 7, sync_each=True)
        out["whole_decode_ms_median"] = statistics.median(ms[2:])
        print(f"eager whole decode of {args.whole_frames} frames: {out['whole_decode_ms_median']:.1f} ms")
    variants = [("plain", gv)]
    if args.compile:
        variants.append(("compiled", GraphedVocoder(voc, torch.device("cuda"), dtype,
                                                    compile_sizes=tuple(c for c in args.chunks
                                                                        if c == 1 or not args.compile_dynamic),
                                                    cudnn_benchmark=args.cudnn_benchmark,
                                                    compile_dynamic=args.compile_dynamic)))
    for name, g in variants:
        for n in args.chunks:
            t0 = time.perf_counter() if name == "compiled" else None
            g.capture([n])
            if name == "compiled" and n not in g.compiled_sizes:
                raise SystemExit(f"chunk {n} was not compiled (see the log)")
            stream = voc.new_stream(batch=1, device=torch.device("cuda"), dtype=dtype)
            codes = torch.randint(0, voc.cfg.codebook_size, (1, q, n), device="cuda")
            time_calls(g, codes, stream, 5)
            ms = time_calls(g, codes, stream, 50)
            prof = profile_calls(g, codes, stream, 20)
            row = {"replay_ms_median": statistics.median(ms), **prof}
            if t0 is not None:
                row["compile_and_capture_s"] = time.perf_counter() - t0
            out[f"{name}_chunk{n}"] = row
            print(f"{name} chunk {n}: {statistics.median(ms):.3f} ms per call, {prof['kernels_per_call']:.0f} kernels, "
                  f"{prof['kernel_us_per_call']:.0f} us of kernel time"
                  + (f", compile + capture {row['compile_and_capture_s']:.1f} s" if t0 is not None else ""))
            for r in prof["by_name"][: args.top]:
                print(f"   {r['per_call']:6.1f} x  {r['us_per_call']:8.1f} us  {r['name']}")
    if args.compile:
        g_plain, g_comp = variants[0][1], variants[1][1]
        for n in args.chunks:
            s_plain = voc.new_stream(batch=1, device=torch.device("cuda"), dtype=dtype)
            s_comp = voc.new_stream(batch=1, device=torch.device("cuda"), dtype=dtype)
            s_eager = voc.new_stream(batch=1, device=torch.device("cuda"), dtype=dtype)
            worst = worst_eager = peak = 0.0
            gen = torch.Generator(device="cuda").manual_seed(n)
            with torch.no_grad():
                for _ in range(20):
                    codes = torch.randint(0, voc.cfg.codebook_size, (1, q, n), device="cuda", generator=gen)
                    a = g_plain.decode_stream(codes, s_plain)
                    b = g_comp.decode_stream(codes, s_comp)
                    c = voc.decode_stream(codes, s_eager, check_values=False)
                    worst = max(worst, float((a - b).abs().max()))
                    worst_eager = max(worst_eager, float((a - c).abs().max()))
                    peak = max(peak, float(a.abs().max()))
            out[f"chunk{n}_max_abs"] = {"compiled_vs_plain_graph": worst, "plain_graph_vs_eager": worst_eager,
                                        "peak": peak}
            print(f"chunk {n}: max |diff| over 20 calls: compiled vs plain graph {worst:.3e}, plain graph vs "
                  f"eager {worst_eager:.3e} (peak {peak:.3f})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print("triton:", out["triton"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

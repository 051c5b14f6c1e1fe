"""What one batched vocoder call costs against batch-1 calls: `python bench/probes/vocoder_batch_cost.py --json F`.

Full-size released vocoder config with random weights (bench/probes/vocoder_bench.py's `build`), bfloat16,
channels-last, as the engine loads it. Per chunk size n and rows b:

* batch 1: the engine's graphs (`GraphedVocoder` with 1 and 3 compiled for their shape, the other
  sizes from the shape-generic compiled step), `decode_stream` per call, state copies included;
* batched: `decode_many` over b streams at different positions through the batched entries that
  `capture_batched` makes, plain graphs and (unless --no-compile-batched) graphs captured from the
  compiled step with symbolic rows.

Each time is the CUDA-event median of --iters calls, each call on an idle GPU (what the engine's
round sees: it waits for the audio). Also the largest difference of the batched audio from the
batch-1 graphs' over 4 calls, against the audio's peak.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

# This folder (the other probes), bench/ (megakernel_check, cuda_timing) and the repository.
sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in range(3)]
from cuda_timing import event_times_ms
from vocoder_bench import build

from pipecat_qwen_fast.vocoder.graphs import GraphedVocoder
from pipecat_qwen_fast.vocoder.vocoder import Vocoder


def advanced_streams(voc: Vocoder, gv: GraphedVocoder, b: int, gen: torch.Generator) -> list:
    """b batch-1 streams, row i advanced by 5 * i frames (different positions, some past the window)."""
    q, size = voc.cfg.num_quantizers, voc.cfg.codebook_size
    streams = []
    for i in range(b):
        st = voc.new_stream(batch=1, device="cuda", dtype=torch.bfloat16)
        if i:
            gv.decode_stream(torch.randint(0, size, (1, q, 5 * i), device="cuda", generator=gen), st)
        streams.append(st)
    return streams


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--sizes", default="1,3,6,12,32")
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--compile-batched", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.backends.cudnn.allow_tf32 = True
    sizes = [int(x) for x in args.sizes.split(",")]
    dtype = torch.bfloat16
    base = build(None, "cuda")
    voc = Vocoder.from_state_dict(base.cfg, base.state_dict(), device="cuda", dtype=dtype)
    voc.use_channels_last()
    q, size = voc.cfg.num_quantizers, voc.cfg.codebook_size
    out: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": args.commit,
                 "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "iters": args.iters,
                 "batch1": {}, "batched": {}}

    def save() -> None:
        args.json.write_text(json.dumps(out, indent=2))

    t0 = time.perf_counter()
    one = GraphedVocoder(voc, torch.device("cuda"), dtype, compile_sizes=(1, 3), compile_dynamic=True,
                         cudnn_benchmark=True)
    one.capture(sizes)
    out["batch1_capture_s"] = time.perf_counter() - t0
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n in sizes:
        st = voc.new_stream(batch=1, device="cuda", dtype=dtype)
        codes = torch.randint(0, size, (1, q, n), device="cuda", generator=gen)
        ms = event_times_ms(lambda c=codes, s=st: one.decode_stream(c, s), args.iters + 3, sync_each=True)[3:]
        out["batch1"][str(n)] = {"ms_per_call": statistics.median(ms), "compiled": n in one.compiled_sizes}
        print(f"batch 1, {n} frames: {statistics.median(ms):.3f} ms a call")
    save()
    variants = ["plain"] + (["compiled"] if args.compile_batched else [])
    for name in variants:
        t0 = time.perf_counter()
        gv = GraphedVocoder(voc, torch.device("cuda"), dtype, cudnn_benchmark=True,
                            compile_batched=name == "compiled")
        gv.capture_batched(sizes, args.max_rows)
        rows_out: dict = {"capture_s": time.perf_counter() - t0, "graphs": len(gv.batched),
                          "compiled": gv.compile_batched, "calls": {}}
        out["batched"][name] = rows_out
        for (n, b) in sorted(gv.batched):
            streams = advanced_streams(voc, one, b, gen)
            codes = torch.randint(0, size, (b, q, n), device="cuda", generator=gen)
            ms = statistics.median(event_times_ms(lambda g=gv, c=codes, s=streams: g.decode_many(c, s), args.iters + 3,
                                                  sync_each=True)[3:])
            # Against the batch-1 graphs from the same states.
            a_streams = advanced_streams(voc, one, b, torch.Generator(device="cuda").manual_seed(b))
            b_streams = [s.clone() for s in a_streams]
            worst = peak = 0.0
            for _ in range(4):
                c = torch.randint(0, size, (b, q, n), device="cuda", generator=gen)
                got = gv.decode_many(c, a_streams)
                want = torch.cat([one.decode_stream(c[i : i + 1], b_streams[i]) for i in range(b)])
                worst = max(worst, float((got.float() - want.float()).abs().max()))
                peak = max(peak, float(want.float().abs().max()))
            t1 = out["batch1"][str(n)]["ms_per_call"]
            rows_out["calls"][f"{n}x{b}"] = {
                "frames": n, "rows": b, "ms_per_call": ms, "ms_per_row": ms / b, "ms_per_frame": ms / (b * n),
                "batch1_calls_ms": b * t1, "speedup_vs_batch1": b * t1 / ms,
                "max_abs_vs_batch1": worst, "peak": peak,
            }
            print(f"{name}: {n} frames x {b} rows: {ms:.3f} ms a call ({ms / (b * n):.4f} a frame; "
                  f"{b} batch-1 calls {b * t1:.2f} ms), max |diff| {worst:.2e} of {peak:.2f}")
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())

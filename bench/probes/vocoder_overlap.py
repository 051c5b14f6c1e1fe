"""Can the streaming vocoder run beside the frame kernel? `python bench/probes/vocoder_overlap.py`

The frame kernel on 128 of the H200's 132 SMs costs +0.02 ms a frame (megakernel_grid_scaling);
a vocoder call on a second CUDA stream could then use the 4 SMs left free while the next frames
decode, instead of taking 0.12-0.13 ms a frame between them (docs/journal/NOTES.md, fourteenth session).
This measures it on a random full-size 0.6B talker and the released vocoder config with random
weights (as bench/megakernel_check.py and bench/probes/vocoder_graph_profile.py build them), the vocoder in
bfloat16 with channels-last weights and its compiled 16-frame graph, as the engine runs it:

* the kernel alone: `--frames` sampled frames launched back to back (talker position 100), on a
  grid of 132 and of 128 blocks;
* the vocoder alone: one 16-frame call (graph replay);
* both: the vocoder call on a second stream, launched with the first frame, the frames on the
  main stream; the time until both are done, and until each is.

CUDA events; medians over `--repeats`. Writes `vocoder_overlap.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# This folder (vocoder_bench), bench/ (megakernel_check, cuda_timing) and the repository.
sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in range(3)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--blocks", nargs="*", type=int, default=[0, 128])
    args = ap.parse_args()

    import megakernel_check as mc
    from cuda_timing import event_times_ms
    from vocoder_bench import build

    from pipecat_qwen_fast.backends import megakernel as mk
    from pipecat_qwen_fast.model.sampling import SamplingParams
    from pipecat_qwen_fast.vocoder.graphs import GraphedVocoder
    from pipecat_qwen_fast.vocoder.vocoder import Vocoder

    dev, bf = torch.device("cuda"), torch.bfloat16
    torch.backends.cudnn.allow_tf32 = True
    base = build(None, "cuda")
    voc = Vocoder.from_state_dict(base.cfg, base.state_dict(), device="cuda", dtype=bf)
    voc.use_channels_last()
    t0 = time.perf_counter()
    gv = GraphedVocoder(voc, dev, bf, compile_sizes=(args.chunk,))
    gv.capture([args.chunk])
    compile_s = time.perf_counter() - t0
    vstream = voc.new_stream(batch=1, device=dev, dtype=bf)
    codes = torch.randint(0, voc.cfg.codebook_size, (1, voc.cfg.num_quantizers, args.chunk), device="cuda")

    talker, cfg = mc.load_reference().random_talker("0.6b", "cuda", seed=0)
    D = cfg.talker.hidden_size
    side = torch.cuda.Stream()
    out: dict = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "commit": os.environ.get("BENCH_COMMIT", "unknown"), "gpu": torch.cuda.get_device_name(),
                 "script": "bench/probes/vocoder_overlap.py", "frames": args.frames, "chunk": args.chunk,
                 "vocoder_compiled": args.chunk in gv.compiled_sizes, "compile_and_capture_s": compile_s, "grids": []}

    def vocoder_call():
        gv.decode_stream(codes, vstream)

    def ev():
        return torch.cuda.Event(enable_timing=True)

    with torch.no_grad():
        for _ in range(5):
            vocoder_call()
        torch.cuda.synchronize()
        voc_alone = event_times_ms(vocoder_call, args.repeats, sync_each=True)
        out["vocoder_alone_ms"] = statistics.median(voc_alone)
        print(f"vocoder {args.chunk}-frame call alone: {out['vocoder_alone_ms']:.3f} ms "
              f"(compiled: {out['vocoder_compiled']})", flush=True)

        for cap in args.blocks:
            mb = mk.MegakernelBackend(talker, dev, bf, max_blocks=cap)
            params = SamplingParams(do_sample=True, subtalker_do_sample=True)
            torch.manual_seed(0)
            st = mc.timing_state(mb, D, 104, params)
            f = mb.frame_args(st, run_talker=True, pos=100)[0]

            def frames(mb=mb, st=st, f=f):
                for _ in range(args.frames):
                    mb.launch(st, f)

            row: dict = {"max_blocks": cap, "grid_blocks": mb.grid_blocks(st)}
            for _ in range(3):
                frames()
            torch.cuda.synchronize()
            alone = event_times_ms(frames, args.repeats, sync_each=True)
            both, k_done, v_done = [], [], []
            for _ in range(args.repeats):
                start, k_end, v_end = ev(), ev(), ev()
                start.record()
                side.wait_event(start)
                with torch.cuda.stream(side):
                    vocoder_call()
                    v_end.record(side)
                frames()
                k_end.record()
                torch.cuda.synchronize()
                k_done.append(start.elapsed_time(k_end))
                v_done.append(start.elapsed_time(v_end))
                both.append(max(k_done[-1], v_done[-1]))
            row.update({
                "frames_alone_ms": statistics.median(alone),
                "frame_ms": statistics.median(alone) / args.frames,
                "both_ms": statistics.median(both),
                "frames_done_ms": statistics.median(k_done),
                "vocoder_done_ms": statistics.median(v_done),
                "sequential_ms": statistics.median(alone) + out["vocoder_alone_ms"],
            })
            out["grids"].append(row)
            print(f"blocks {row['grid_blocks']:4}: {args.frames} frames {row['frames_alone_ms']:.3f} ms "
                  f"({row['frame_ms']:.4f} a frame); with the vocoder beside them {row['both_ms']:.3f} ms "
                  f"(frames done {row['frames_done_ms']:.3f}, vocoder done {row['vocoder_done_ms']:.3f}); "
                  f"one after the other {row['sequential_ms']:.3f}", flush=True)
            mb.release(st)
            del mb
            torch.cuda.empty_cache()
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocoder_overlap.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

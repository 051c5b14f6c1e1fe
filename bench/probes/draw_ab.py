"""A round's sampling draws, before and after the counter-based draw (model/sampling.py):
`python bench/probes/draw_ab.py --json F`. No model: the draws alone, at the 0.6B's vocabularies
(code 0: 3072 ids; codes 1-15: 2048 each), for `rows` sessions in one batched round.

- before: what `GraphBackend` did until 29a5383, one frame ahead: each session's own
  torch.Generator filling Exp(1) noise for its code 0 and its 15 residual codes (two launches a
  session), then in the frame argmax(softmax / noise) over the batch.
- after: the 16 uniforms of every row from the slot seeds (`counter_uniform`) and the inverse-CDF
  draw, all rows at once.

Host time to launch a round's draws (perf_counter, the GPU idle before each, median) and the
GPU's time (CUDA events, median). Predicted: the before's host time grows ~2 launches x ~5 us a
session (~5 ms at 512 rows, which is what the stack samples' 7.5 % of the engine thread at 384
calls suggests) and its GPU time likewise with the sessions (one small kernel each); the after's
stays near a dozen launches whatever the rows, its GPU time a few passes over the logits, as the
before's argmax.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in range(3)]
from cuda_timing import event_times_ms, host_launch_us

from pipecat_qwen_fast.model.sampling import counter_uniform, draw, warp_logits

V0, V, GROUPS = 3072, 2048, 16


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--rows", default="64,128,256,512")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    dev = torch.device("cuda")
    out: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": args.commit,
                 "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "iters": args.iters, "rows": {}}
    for rows in [int(r) for r in args.rows.split(",")]:
        g = torch.Generator(device=dev).manual_seed(0)
        logits0 = warp_logits(torch.randn(rows, V0, device=dev, generator=g) * 3, 0.9, 50, 1.0)
        logits = warp_logits(torch.randn(rows, GROUPS - 1, V, device=dev, generator=g) * 3, 0.9, 50, 1.0)
        gens = [torch.Generator(device=dev).manual_seed(i) for i in range(rows)]
        noise0 = torch.ones(rows, V0, device=dev)
        noise = torch.ones(rows, GROUPS - 1, V, device=dev)
        seeds = torch.arange(rows, device=dev)[:, None]
        frame = torch.full((rows, 1), 7, device=dev)
        groups = torch.arange(GROUPS, device=dev)

        def before():
            for i, gen in enumerate(gens):
                noise0[i].exponential_(1, generator=gen)
                noise[i].exponential_(1, generator=gen)
            a = torch.argmax(logits0.softmax(-1) / noise0, dim=-1)
            b = torch.argmax(logits.softmax(-1) / noise, dim=-1)
            return a, b

        def after():
            u = counter_uniform(seeds, frame, groups)
            return draw(logits0, u[:, 0]), draw(logits, u[:, 1:])

        row = {}
        for name, fn in (("before", before), ("after", after)):
            fn()
            row[f"{name}_host_us"] = host_launch_us(fn, args.iters)
            row[f"{name}_gpu_ms"] = statistics.median(event_times_ms(fn, args.iters + 3, sync_each=True)[3:])
        out["rows"][rows] = row
        print(f"{rows} rows: host {row['before_host_us']:.0f} -> {row['after_host_us']:.0f} us, "
              f"GPU {row['before_gpu_ms']:.3f} -> {row['after_gpu_ms']:.3f} ms (before -> after)")
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

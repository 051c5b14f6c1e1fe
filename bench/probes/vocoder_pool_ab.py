"""A batched vocoder call over pooled streams against the same call copying each stream's state:
`python bench/probes/vocoder_pool_ab.py --json F` (vocoder/pool.py).

Full-size released vocoder config with random weights, bfloat16, channels-last, one
`GraphedVocoder` with a pool and plain batched graphs (what is compared, the moves of the
states, does not depend on how the step was captured). Per frames x rows: the host's time to
launch one `decode_many` (perf_counter, the GPU idle before each call, so nothing waits for a
full queue), the GPU's time for the call (CUDA events, median), and whether the two ways give
the same audio and states bit for bit (the same graph replays on the same rows).

Predicted: the copies' host time grows with the rows (24 buffers a stream in one foreach each
way, ~1500 tensors at 64 rows), the pooled one's does not (one index copy and two more replays);
on the GPU both move the same bytes.
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
from vocoder_bench import build

from pipecat_qwen_fast.vocoder.graphs import GraphedVocoder
from pipecat_qwen_fast.vocoder.vocoder import Vocoder


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--calls", default="1x8,1x32,1x64,2x32,4x16", help="frames x rows")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    calls = [tuple(int(x) for x in c.split("x")) for c in args.calls.split(",")]
    dtype = torch.bfloat16
    base = build(None, "cuda")
    voc = Vocoder.from_state_dict(base.cfg, base.state_dict(), device="cuda", dtype=dtype)
    voc.use_channels_last()
    q, size = voc.cfg.num_quantizers, voc.cfg.codebook_size
    rows_max = max(b for _, b in calls)
    t0 = time.perf_counter()
    gv = GraphedVocoder(voc, torch.device("cuda"), dtype, cudnn_benchmark=False, pool_slots=2 * rows_max)
    gv.capture_batched(sorted({n for n, _ in calls}), rows_max)
    out: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": args.commit,
                 "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "iters": args.iters,
                 "capture_s": time.perf_counter() - t0, "pool_gb": gv.pool.row_bytes * (gv.pool.slots + 1) / 1e9,
                 "calls": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, b in calls:
        if (n, b) not in gv.batched:
            print(f"{n} x {b}: no batched entry; skipped")
            continue
        pooled = [gv.new_stream() for _ in range(b)]
        own = [voc.new_stream(batch=1, device="cuda", dtype=dtype, packed=True) for _ in range(b)]
        codes = torch.randint(0, size, (b, q, n), device="cuda", generator=gen)
        same = True
        for _ in range(3):  # from equal states, equal calls: bit for bit
            c = torch.randint(0, size, (b, q, n), device="cuda", generator=gen)
            same &= torch.equal(gv.decode_many(c, pooled), gv.decode_many(c, own))
        for p, o in zip(pooled, own):
            same &= torch.equal(p.keys, o.keys) and torch.equal(p.histories[-1], o.histories[-1])
            same &= torch.equal(p.position, o.position)
        row: dict = {"frames": n, "rows": b, "bit_equal": bool(same)}
        for name, streams in (("pooled", pooled), ("copied", own)):
            fn = lambda s=streams, c=codes: gv.decode_many(c, s)
            row[f"{name}_host_us"] = host_launch_us(fn, args.iters)
            row[f"{name}_gpu_ms"] = statistics.median(event_times_ms(fn, args.iters + 3, sync_each=True)[3:])
        out["calls"][f"{n}x{b}"] = row
        print(f"{n} x {b}: host {row['copied_host_us']:.0f} -> {row['pooled_host_us']:.0f} us, GPU "
              f"{row['copied_gpu_ms']:.3f} -> {row['pooled_gpu_ms']:.3f} ms (copied -> pooled), bit-equal {same}")
        args.json.write_text(json.dumps(out, indent=2))
    args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How the frame kernel's time scales with the number of blocks (one per SM) it runs on.

    python bench/probes/megakernel_grid_scaling.py [--out DIR] [--blocks 132 110 88 66] [--size 0.6b]

A design that gives up compute SMs (copier blocks that only stream weights, so that the compute
blocks' arrival fences no longer wait for copies: docs/journal/NOTES.md, fourteenth session) starts from
what the kernel costs on fewer blocks today. For each grid (`MegakernelBackend(max_blocks=N)`) on
the same random full-size talker and seeded inputs as bench/megakernel_check.py: CUDA-event medians
of single launches (frame, talker alone, predictor alone; greedy and sampling; talker position
100), the plain per-phase profile, and whether the codes equal the full grid's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # megakernel_check, megakernel_ab, cuda_timing


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--blocks", nargs="*", type=int, default=[0, 110, 88, 66])
    ap.add_argument("--size", default="0.6b", choices=["0.6b", "1.7b"])
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()

    import torch
    from megakernel_ab import run_one

    result = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "commit": os.environ.get("BENCH_COMMIT", "unknown"), "gpu": torch.cuda.get_device_name(),
              "script": "bench/probes/megakernel_grid_scaling.py", "size": args.size, "grids": []}
    first_codes = None
    for cap in args.blocks:
        # megakernel_ab's measurement of one build, on this grid (it loads the same random talker).
        row = {"max_blocks": cap, **run_one(args.iters, ROOT, args.size, [], max_blocks=cap)}
        codes = {tag: row.pop(f"{tag}_codes") for tag in ("greedy", "sampling")}
        if first_codes is None:
            first_codes = codes
        row["codes_identical_to_first"] = codes == first_codes
        result["grids"].append(row)
        print(f"blocks {row['grid_blocks']:4}  " + "  ".join(f"{k} {v['median_ms']:.4f}" for k, v in row["modes"].items())
              + f"  codes identical: {row['codes_identical_to_first']}", flush=True)
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "megakernel_grid_scaling.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The program that bench/probes/ncu_profile.sh runs under Nsight Compute: one frame kernel launch of each
kind (whole frame, talker alone, predictor alone) at talker position 100 on the random full-size
talker of bench/megakernel_check.py, inside a profiler range, after a warm-up outside it.

    ncu --profile-from-start off ... python bench/probes/ncu_profile.py [--size 0.6b] [--sampling]

Run alone it times the same launches (CUDA events), to check that the range holds what it should.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # megakernel_check, megakernel_ab, cuda_timing


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="0.6b", choices=["0.6b", "1.7b"])
    ap.add_argument("--sampling", action="store_true", help="sampled codes (default greedy)")
    ap.add_argument("--pos", type=int, default=100)
    ap.add_argument("--kinds", nargs="*", default=["frame", "talker", "predictor"],
                    choices=["frame", "talker", "predictor"])
    args = ap.parse_args()
    import megakernel_check as mc
    import torch

    from pipecat_qwen_fast.backends import megakernel as mk
    from pipecat_qwen_fast.model.sampling import SamplingParams

    talker, cfg = mc.load_reference().random_talker(args.size, "cuda", seed=0)
    mb = mk.MegakernelBackend(talker, torch.device("cuda"), torch.bfloat16)
    params = SamplingParams(do_sample=args.sampling, subtalker_do_sample=args.sampling)
    torch.manual_seed(0)
    st = mc.timing_state(mb, cfg.talker.hidden_size, args.pos + 4, params)
    frames = {
        "frame": mb.frame_args(st, run_talker=True, pos=args.pos)[0],
        "talker": mb.frame_args(st, run_talker=True, run_predictor=False, pos=args.pos)[0],
        "predictor": mb.frame_args(st, run_talker=False)[0],
    }
    for k in args.kinds:
        times = mc.summary(mc.time_launches(mb, st, frames[k], 50))
        print(f"{k}: median {times['median_ms']:.4f} ms over 50 launches (outside the profiler range)", flush=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for k in args.kinds:
        mb.launch(st, frames[k])  # profiled in this order: ncu's results 0, 1, 2
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(args.kinds), "| grid", mb.grid_blocks(st), "blocks |",
          os.environ.get("QWEN_FAST_MK_DEFINES", "") or "plain build", flush=True)
    mb.release(st)
    return 0


if __name__ == "__main__":
    sys.exit(main())

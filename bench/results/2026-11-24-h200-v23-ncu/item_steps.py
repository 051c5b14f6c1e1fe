"""The attention item's samples by step (bench/NOTES.md, v24: the table of the item's steps), from
this folder's profile of d9ef144. The step boundaries are line ranges of d9ef144's
cuda/mk_attention.cuh, so this script only fits this profile.

    python bench/results/2026-11-24-h200-v23-ncu/item_steps.py > item_steps.txt
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "bench"))
import ncu_summary as ns

# d9ef144's mk_attention.cuh: line range -> step. dot4 / ld_f4 (lines 83-88) and the warp
# reductions (mk_util.cuh) and intrinsics count for the attention line that called them.
STEPS = [((94, 107), "q/k/v loads + QK-norm/RoPE"), ((142, 161), "q/k/v loads + QK-norm/RoPE"),
         ((111, 127), "merge"), ((129, 138), "scores"), ((164, 178), "scores"),
         ((179, 184), "softmax"), ((185, 194), "P.V"), ((195, 200), "output of a single chunk"),
         ((201, 214), "publication: fence, pair barrier, count"), ((215, 226), "merge")]
# (result, call site of attention_item in qwen_mk.cu, items x warps per launch, warp-us a sample)
SITES = {"talker": (1, ("qwen_mk.cu", 755), 28 * 32 * 2), "predictor": (2, ("qwen_mk.cu", 846), 75 * 128 * 2)}


def step_of(stack) -> str:
    for file, line in stack:  # leaf first: the innermost attention line decides
        if file != "mk_attention.cuh" or 83 <= line <= 88:
            continue
        for (a, b), name in STEPS:
            if a <= line <= b:
                return name
    return "other"


def main() -> int:
    kernels = ns.read_sass_csv(HERE / "sass.csv.gz")
    ns.read_raw_duration(HERE / "raw.csv.gz", kernels)
    _, stacks = ns.read_listing(HERE / "nvdisasm_d9ef144_sm90a_short.sass.gz", ns.DEFAULT_SYMBOL)
    for label, (k, site, warp_items) in SITES.items():
        kernel = kernels[k]
        samples = collections.Counter()
        for ins in kernel.instructions:
            stack = stacks.get(ins.offset, ())
            if site in stack:
                samples[step_of(stack)] += sum(ins.stalls.values())
        total = sum(samples.values())
        us_per_sample = kernel.duration_us * kernel.grid * kernel.block // ns.WARP / sum(ns.stall_totals(kernel).values())
        print(f"{label}: {total} samples in attention_item, {us_per_sample:.2f} warp-us a sample, "
              f"{total * us_per_sample / warp_items:.2f} us per item and warp")
        for name, n in samples.most_common():
            print(f"  {name:42s} {n:5d}  {n * us_per_sample / warp_items:5.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())

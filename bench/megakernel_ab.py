"""A/B timing of megakernel build variants in one device call (compile-time switches).

    python bench/megakernel_ab.py [--out DIR] NAME=DEFINES ...      e.g.  base= steps=QMK_TRACE_STEPS
    NAME=@DIR: another checkout (e.g. a `git worktree` of an older commit, carried to the device)

Each variant runs in its own process (the library is loaded once per process) with
QWEN_FAST_MK_DEFINES set to its defines (own cache entry), or with another checkout's package,
kernel and bench helpers, on the same random full-size talker
as bench/megakernel_check.py (0.6B, or `--size 1.7b`): CUDA-event medians of single launches (frame and talker
alone at talker position 100, the predictor alone) for greedy and sampling, a check that each
run's greedy and (seeded) sampled codes equal the first variant's, and the plain per-phase profile. Variants run
in the order given and then again in reverse, so drift over the call shows in the two medians.
`--positions 150 1000` (after the variants) also times the talker alone at those positions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_one(iters: int, root: Path, size: str, positions: list[int], max_blocks: int = 0) -> dict:
    import torch

    sys.path.insert(0, str(root))
    sys.path.insert(0, str(root / "bench"))
    import megakernel_check as mc

    from pipecat_qwen_fast.backends import megakernel as mk
    from pipecat_qwen_fast.model.sampling import SamplingParams

    talker, cfg = mc.load_reference().random_talker(size, "cuda", seed=0)
    mb = mk.MegakernelBackend(talker, torch.device("cuda"), torch.bfloat16, max_blocks=max_blocks)
    D = cfg.talker.hidden_size
    out: dict = {"modes": {}}
    for sampling in (False, True):
        params = SamplingParams(do_sample=sampling, subtalker_do_sample=sampling)
        torch.manual_seed(0)  # the same prefill and K/V in every variant
        st = mc.timing_state(mb, D, max([104] + [p + 4 for p in positions]), params)
        out["grid_blocks"] = mb.grid_blocks(st)
        tag = "sampling" if sampling else "greedy"
        # Seeded (timing_state's seed 1), so sampled codes must match across variants too.
        out[f"{tag}_codes"] = torch.stack([mb.decode_frame(st).clone() for _ in range(8)]).tolist()
        rows = {
            f"frame_{tag}_pos100": mb.frame_args(st, run_talker=True, pos=100)[0],
            f"talker_only_{tag}_pos100": mb.frame_args(st, run_talker=True, run_predictor=False, pos=100)[0],
            f"predictor_only_{tag}": mb.frame_args(st, run_talker=False)[0],
        }
        for p in positions:
            rows[f"talker_only_{tag}_pos{p}"] = mb.frame_args(st, run_talker=True, run_predictor=False, pos=p)[0]
        for name, f in rows.items():
            mc.time_launches(mb, st, f, 20)
            out["modes"][name] = mc.summary(mc.time_launches(mb, st, f, iters))
        out[f"profile_{tag}_pos100"] = mc.phase_profile(mb, st, mb.frame_args(st, run_talker=True, pos=100)[0])
        mb.release(st)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--size", default="0.6b", choices=["0.6b", "1.7b"])
    ap.add_argument("--positions", nargs="*", type=int, default=[],
                    help="also time the talker alone at these positions (the K/V cache then holds them all)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    ap.add_argument("variants", nargs="*")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.iters, Path(args.root), args.size, args.positions)))
        return 0
    variants = [v.split("=", 1) for v in args.variants]
    result = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "commit": os.environ.get("BENCH_COMMIT", "unknown"), "script": "bench/megakernel_ab.py", "size": args.size,
              "positions": args.positions,
              "variants": {name: {"defines": d, "runs": []} for name, d in variants}}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, defines in variants + variants[::-1]:
        root = Path(defines[1:]).resolve() if defines.startswith("@") else ROOT
        env = dict(os.environ, QWEN_FAST_MK_DEFINES="" if defines.startswith("@") else defines.replace(",", " "))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--one", "--iters", str(args.iters), "--root", str(root),
                               "--size", args.size, "--positions", *map(str, args.positions)],
                              cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False)
        run = {"seconds": time.perf_counter() - t0}
        if proc.returncode != 0:
            run["error"] = proc.stderr[-3000:]
        else:
            run.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        result["variants"][name]["runs"].append(run)
        modes = run.get("modes", {})
        print(f"{name:14} {defines:36} " + "  ".join(f"{k} {v['median_ms']:.4f}" for k, v in modes.items())
              + (f"  ERROR {run['error'][-400:]}" if "error" in run else ""), flush=True)
        (out_dir / "megakernel_ab.json").write_text(json.dumps(result, indent=2))
    first = result["variants"][variants[0][0]]["runs"][0]
    for name, v in result["variants"].items():
        for tag in ("greedy", "sampling"):
            same = [r.get(f"{tag}_codes") == first.get(f"{tag}_codes") for r in v["runs"]]
            print(f"{name:14} {tag} codes identical to {variants[0][0]}: {same}")
            v[f"{tag}_codes_identical_to_first"] = same
    (out_dir / "megakernel_ab.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the talker's attention phase spends its time: a QMK_TRACE_ATTN build stamps every step
of every talker attention item (all blocks, all layers) of one talker-only launch.

    python bench/probes/attention_trace.py [--positions 100 31 200] [--out DIR]

Per position it prints, as medians over layers 1-27 (layer 0 also pays the launch's start):
the q/k/v phase's arrivals and barrier exit, then per item the tile wait and the item's steps
(q/k loads + QK-norm/RoPE, scores, softmax, P.V, publishing the partial + fence + count, the
merge by the head's last item), its end, and the attention barrier's exit; all in us from the
q/k/v barrier's first exit (global timer) or, inside an item, from the SM clock.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["QWEN_FAST_MK_DEFINES"] = (os.environ.get("QWEN_FAST_MK_DEFINES", "") + " QMK_TRACE_ATTN").strip()
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # megakernel_check, megakernel_ab, cuda_timing

SLOTS, BLOCKS, LAYERS = 24, 160, 64
STEPS = [("q/k/v loads + norm/RoPE", 2, 3), ("scores", 3, 4), ("softmax", 4, 5), ("P.V", 5, 6),
         ("publish + fence + count", 6, 7), ("merge", 7, 8)]


def read(lib, torch):
    buf = (ctypes.c_int64 * (LAYERS * BLOCKS * SLOTS))()
    torch.cuda.synchronize()
    rc = lib.qmk_attn_trace_read(buf, ctypes.c_int64(ctypes.sizeof(buf)))
    if rc:
        raise RuntimeError(f"qmk_attn_trace_read: {rc}")
    import numpy as np

    return np.frombuffer(buf, dtype=np.int64).reshape(LAYERS, BLOCKS, SLOTS).copy()


def analyse(t, layers: int, blocks: int) -> dict:
    rows = []
    for layer in range(1, layers):
        L = t[layer, :blocks]
        t0 = L[:, 16].min()  # first exit of the q/k/v barrier

        def us(v, t0=t0):  # global timer ns -> us after t0
            return (v - t0) / 1e3

        items = [b for b in range(blocks) if L[b, 0] != 0]
        hz = []
        for b in items:
            if L[b, 10] > L[b, 1]:
                hz.append((L[b, 12] - L[b, 2]) / (L[b, 10] - L[b, 1]))
        ghz = statistics.median(hz) if hz else 1.98
        r = {
            "qkv_first_arrival": us(L[:, 15].min()), "qkv_last_arrival": us(L[:, 15].max()),
            "qkv_last_exit": us(L[:, 16].max()),
            "items": len(items),
            "tile_ready_max": max(us(L[b, 1]) for b in items),
            "item_end_max": max(us(L[b, 10]) for b in items),
            "attn_last_arrival": us(L[:, 13].max()),
            "attn_first_exit": us(L[:, 14].min()), "attn_last_exit": us(L[:, 14].max()),
            "sm_ghz": ghz,
        }
        for name, a, b in STEPS:
            vals = [(L[x, b] - L[x, a]) / ghz / 1e3 for x in items if L[x, b] and L[x, a] and (name != "merge" or L[x, 9])]
            r[name] = statistics.median(vals) if vals else None
            r[name + " max"] = max(vals) if vals else None
        merger = [x for x in items if L[x, 9]]
        r["merging_item_end"] = statistics.median([us(L[x, 10]) for x in merger]) if merger else None
        r["plain_item_end"] = statistics.median([us(L[x, 10]) for x in items if not L[x, 9]])
        r["item_start_median"] = statistics.median([us(L[x, 0]) for x in items])
        rows.append(r)
    keys = rows[0].keys()
    return {k: (statistics.median([r[k] for r in rows if r[k] is not None]) if any(r[k] is not None for r in rows) else None)
            for k in keys}


GRID_SEQ = 512


def grid_barriers(lib, torch, blocks: int, name) -> dict:
    """Per phase kind, medians over the launch's barriers (us): arrival spread (first to last
    block done), the arrival itself (fence + atomic), last arrival to first exit (the barrier's own
    latency), exit spread, and the work before the arrival (previous exit to done, median block)."""
    import numpy as np

    buf = (ctypes.c_int64 * (BLOCKS * GRID_SEQ * 4))()
    torch.cuda.synchronize()
    if lib.qmk_grid_trace_read(buf, ctypes.c_int64(ctypes.sizeof(buf))):
        raise RuntimeError("qmk_grid_trace_read")
    t = np.frombuffer(buf, dtype=np.int64).reshape(BLOCKS, GRID_SEQ, 4)[:blocks]
    per: dict[str, list[dict]] = {}
    prev_exit = None
    for s in range(GRID_SEQ):
        if t[0, s, 0] == 0:
            break
        pre, arr, ex = t[:, s, 0], t[:, s, 1], t[:, s, 2]
        grouped = t[0, s, 3] >= 64
        r = {"arrival_spread": (pre.max() - pre.min()) / 1e3,
             "arrive": float(np.median(arr - pre)) / 1e3, "arrive_max": (arr - pre).max() / 1e3}
        if not grouped:
            r["last_arrival_to_first_exit"] = (ex.min() - pre.max()) / 1e3
            r["last_arrived_to_first_exit"] = (ex.min() - arr.max()) / 1e3
            r["exit_spread"] = (ex.max() - ex.min()) / 1e3
        if prev_exit is not None:
            r["work_median"] = float(np.median(pre - prev_exit)) / 1e3
            r["work_max"] = (pre - prev_exit).max() / 1e3
        per.setdefault(("grouped " if grouped else "") + name(int(t[0, s, 3]) % 64), []).append(r)
        prev_exit = ex if not grouped else prev_exit
    return {k: {"count": len(v), **{m: statistics.median([r[m] for r in v if m in r])
                                     for m in v[-1] if any(m in r for r in v)}}
            for k, v in per.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--positions", nargs="*", type=int, default=[100, 31, 200])
    ap.add_argument("--size", default="0.6b", choices=["0.6b", "1.7b"])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    import megakernel_check as mc
    import torch

    from pipecat_qwen_fast.backends import megakernel as mk
    from pipecat_qwen_fast.model.sampling import SamplingParams

    talker, cfg = mc.load_reference().random_talker(args.size, "cuda", seed=0)
    mb = mk.MegakernelBackend(talker, torch.device("cuda"), torch.bfloat16)
    lib = mb.lib
    torch.manual_seed(0)
    st = mc.timing_state(mb, cfg.talker.hidden_size, max(args.positions) + 4, SamplingParams())
    layers = cfg.talker.stack.num_layers
    blocks = mb.grid_blocks(st)
    result = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "commit": os.environ.get("BENCH_COMMIT", "unknown"), "gpu": torch.cuda.get_device_name(),
              "script": "bench/probes/attention_trace.py", "size": args.size, "blocks": blocks, "positions": {}}
    for pos in args.positions:
        f = mb.frame_args(st, run_talker=True, run_predictor=False, pos=pos)[0]
        for _ in range(10):
            mb.launch(st, f)
        runs = []
        for _ in range(args.runs):
            lib.qmk_attn_trace_clear()
            mb.launch(st, f)
            runs.append(analyse(read(lib, torch), layers, blocks))
        med = {k: (statistics.median([r[k] for r in runs if r[k] is not None])
                   if any(r[k] is not None for r in runs) else None) for k in runs[0]}
        result["positions"][str(pos)] = med
        print(f"position {pos} ({med['items']:.0f} items), medians over layers 1-{layers - 1} and {args.runs} launches, us:")
        for k, v in med.items():
            print(f"  {k:32s} {'-' if v is None else f'{v:.2f}'}")
    for label, f in (("talker_only_pos100", mb.frame_args(st, run_talker=True, run_predictor=False, pos=100)[0]),
                     ("frame_pos100", mb.frame_args(st, run_talker=True, pos=100)[0])):
        for _ in range(10):
            mb.launch(st, f)
        times = mc.summary(mc.time_launches(mb, st, f, 100))
        result["median_ms_" + label] = times["median_ms"]
        print(f"{label}: median {times['median_ms']:.4f} ms (trace build)")
        lib.qmk_attn_trace_clear()
        mb.launch(st, f)
        g = grid_barriers(lib, torch, blocks, mc.phase_name)
        result["grid_" + label] = g
        print(f"grid barriers, {label} (us, medians over the barriers of each phase kind):")
        for k, v in g.items():
            print(f"  {k:28s} " + " ".join(f"{m}={x:.2f}" if isinstance(x, float) else f"{m}={x}" for m, x in v.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"attention_trace_{args.size}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

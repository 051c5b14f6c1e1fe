"""How long `QwenTTSEngine.from_pretrained` takes, each load in a fresh process:
`python bench/probes/load_time.py --checkpoint DIR [--json F] VARIANT ...`.

A variant is `name` or `name:nocudnnbench` (the vocoder graphs captured without cuDNN's algorithm
timing). The first load of a machine meets a cold inductor cache and compiles the vocoder steps;
later loads reuse the compiled code from disk but capture every graph again. Prints and writes
(--json) per variant the load seconds and, from the engine's log, the seconds spent compiling or
capturing each vocoder chunk size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import contextlib, logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import torch
import pipecat_qwen_fast.vocoder.graphs as vg
if sys.argv[2] == "nocudnnbench":
    vg._cudnn_benchmark = lambda on: contextlib.nullcontext()
from pipecat_qwen_fast import QwenTTSEngine
t0 = time.perf_counter()
engine = QwenTTSEngine.from_pretrained(sys.argv[1], device="cuda", progress=False)
torch.cuda.synchronize()
print("LOAD_S", time.perf_counter() - t0, flush=True)
engine.close()
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--json", type=Path)
    ap.add_argument("variants", nargs="+")
    args = ap.parse_args()
    out = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": os.environ.get("BENCH_COMMIT", "unknown"), "script": "bench/probes/load_time.py", "runs": []}
    for v in args.variants:
        name, _, mode = v.partition(":")
        proc = subprocess.run([sys.executable, "-c", CHILD, args.checkpoint, mode or "default"], cwd=ROOT,
                              capture_output=True, text=True, timeout=900, check=False)
        text = proc.stdout + proc.stderr
        load = re.search(r"LOAD_S ([0-9.]+)", text)
        sizes = [(int(n), float(s)) for n, s in re.findall(r"vocoder step for (\d+)-frame chunks .*? in ([0-9.]+) s", text)]
        run = {"name": name, "mode": mode or "default", "load_s": float(load.group(1)) if load else None,
               "vocoder_steps_s": sizes, "vocoder_steps_total_s": sum(s for _, s in sizes)}
        if proc.returncode != 0:
            run["error"] = text[-3000:]
        out["runs"].append(run)
        print(f"{name:12} {run['mode']:13} load {run['load_s']} s, vocoder steps {run['vocoder_steps_total_s']:.1f} s "
              f"over {len(sizes)} sizes" + (f"  ERROR {text[-500:]}" if "error" in run else ""), flush=True)
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

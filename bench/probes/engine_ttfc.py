"""The megakernel engine's TTFC and streaming RTF alone (megakernel_check.py's engine stage), with
the load time: `python bench/probes/engine_ttfc.py [--json FILE] [--run-ahead-ab]`. Random 0.6B
CustomVoice checkpoint. --run-ahead-ab then measures warm TTFC and streaming again with
QwenTTSEngine.run_ahead off, on, off, on (same engine, same texts and seeds)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: megakernel_check, cuda_timing
import megakernel_check as mc  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--run-ahead-ab", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    r = mc.measure_engine([False, True, False, True] if args.run_ahead_ab else None)
    mc.print_engine(r)
    print(f"load (checkpoint on disk -> warm engine) {r.get('load_s', float('nan')):.1f} s")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

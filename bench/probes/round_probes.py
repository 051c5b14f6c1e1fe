"""The round probes on one engine, loaded once: `python bench/probes/round_probes.py --model DIR --out DIR`.

A cold engine load and its full warm-up take minutes of a device call; `row_prefill_ab.py`
(a round's opens with and without the row prefill) and `batch_overlap.py` (the vocoder beside
the batched decode) each load their own. This runs both, with their default arguments, into
OUT/row-prefill and OUT/batch-overlap (`device_run.sh round-probes`).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1])]  # the repository


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    engine = load("round_common").load_warm_engine(args.model, args.device, args.dtype,
                                                   lambda msg: print(f"round_probes: {msg}", flush=True))
    try:
        failed = run_all(engine, args.model, args.out)
    finally:
        engine.close()
    return 1 if failed else 0


def run_all(engine, model: Path, out: Path, extra: dict[str, list[str]] | None = None) -> list[str]:
    """Each probe's `run` on `engine` (`extra`: more arguments per probe); the names that failed."""
    failed = []
    for name, folder in (("batch_overlap", "batch-overlap"), ("row_prefill_ab", "row-prefill")):
        probe = load(name)
        probe_args = probe.parse_args(["--model", str(model), "--out", str(out / folder),
                                       *(extra or {}).get(name, [])])
        try:
            probe.run(engine, probe_args)
        except Exception as exc:  # noqa: BLE001 - the other probe still runs; the exit code says
            print(f"round_probes: {name} failed: {type(exc).__name__}: {exc}", flush=True)
            failed.append(name)
    return failed


if __name__ == "__main__":
    sys.exit(main())

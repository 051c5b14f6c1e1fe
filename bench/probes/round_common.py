"""What the round probes (`row_prefill_ab.py`, `batch_overlap.py`, `round_probes.py`) share: the
engine loaded as `bench fleet` loads it, a result's header, medians, and writing the result."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]  # the repository
from pipecat_qwen_fast.bench.main import git_commit


def load_warm_engine(model: Path, device: str, dtype: str, log: Callable[[str], None]):
    """`from_pretrained`, then the whole warm-up (the batch path and its row prefills captured) and
    the engine thread's first batched prefill, as a fleet's engine is before its first level."""
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine

    t0 = time.perf_counter()
    engine = QwenTTSEngine.from_pretrained(model, device=device, dtype=dtype, progress=False)
    engine.finish_warmup()
    engine.prepare_thread()
    log(f"engine loaded and warm in {time.perf_counter() - t0:.1f} s: {engine.backend.name} on {engine.device}")
    return engine


def probe_main(args: argparse.Namespace, run: Callable, log: Callable[[str], None]) -> int:
    """A probe's `main`: its engine loaded and warm, its `run`, the engine closed."""
    engine = load_warm_engine(args.model, args.device, args.dtype, log)
    try:
        run(engine, args)
    finally:
        engine.close()
    return 0


def batch_path(engine, attr: str):
    """(backend, its batch side: the auto backend's `bulk` or the backend itself), or exit
    naming what is missing: a batch side with `attr`."""
    backend = engine.backend
    bulk = getattr(backend, "bulk", backend)
    if getattr(bulk, attr, None) is None:
        raise SystemExit(f"backend {getattr(backend, 'name', type(backend).__name__)} has no batch path with {attr}")
    return backend, bulk


def header(probe: str, engine, args: argparse.Namespace, skip_args: tuple[str, ...] = ()) -> dict:
    """A result's first fields: what ran, where, when, at which commit, with which arguments."""
    cuda = engine.device.type == "cuda"
    backend = engine.backend
    return {
        "probe": probe,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": args.commit or git_commit(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in skip_args},
        "device": str(engine.device),
        "device_name": torch.cuda.get_device_name(engine.device) if cuda else None,
        "torch": torch.__version__,
        "backend_name": getattr(backend, "name", type(backend).__name__),
    }


def summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"n": len(ms), "median": statistics.median(ms), "p90": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
            "min": ms[0]}


def write(out: Path, name: str, result: dict, markdown: str) -> None:
    """OUT/NAME.json and OUT/NAME.md; the table printed too."""
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (out / f"{name}.md").write_text(markdown)
    print(markdown, flush=True)

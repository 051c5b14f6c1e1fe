"""Helpers shared by the baseline drivers (they run in their own processes, without our package).

The drivers use each baseline as its users do, through its public API; what is ours here is only
the timing around those calls and one compatibility fix (`fix_rope_init_for_transformers5`).

`pipecat_qwen_fast` is not on a driver's path (run_h200.sh does not install it; the drivers get the
baselines' wheel folder only), so `Budget`, `Report`, `summarize` and `max_underrun` are small
copies of those in `pipecat_qwen_fast/bench/engine.py`; tests/test_bench.py runs both copies of
`max_underrun` and `summarize` on the same cases.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

SAMPLES_PER_FRAME = 1920
FRAME_RATE_HZ = 12.5


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


class Report:
    """The driver's JSON result, rewritten after every stage so a stopped driver still reports."""

    def __init__(self, path: Path, data: dict):
        self.path = Path(path)
        self.data = data
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.save()


def summarize(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "p50": None, "p95": None, "min": None, "max": None}
    return {
        "n": len(values),
        "p50": float(np.percentile(values, 50)),
        "p95": float(np.percentile(values, 95)),
        "min": float(min(values)),
        "max": float(max(values)),
    }


def max_underrun(arrivals: list[float], durations: list[float]) -> float:
    """Longest silence a player that starts at the first chunk would hear (0 = never starved)."""
    worst, played = 0.0, 0.0
    for k in range(1, len(arrivals)):
        played += durations[k - 1]
        worst = max(worst, (arrivals[k] - arrivals[0]) - played)
    return worst


def parse_args(argv: list[str] | None, budget_s: float) -> argparse.Namespace:
    """The flags `pipecat_qwen_fast.bench.main` passes to every driver."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", type=float, default=budget_s)
    p.add_argument("--texts", required=True)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def load_texts(path: str) -> dict:
    return json.loads(Path(path).read_text())


def median(values: list[float | None]) -> float | None:
    """Upper median of the values that were measured (None = not measured)."""
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class CallTimer:
    """Wall time of every call of one bound method, bracketed by device synchronizes.

    Installed on the instance only (the class is untouched) and removed with `restore()`.
    """

    def __init__(self, owner: object, name: str):
        self.owner, self.name = owner, name
        self.original = getattr(owner, name)
        self.seconds: list[float] = []

        def timed(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            out = self.original(*args, **kwargs)
            sync()
            self.seconds.append(time.perf_counter() - t0)
            return out

        setattr(owner, name, timed)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.original)

    def take(self) -> list[float]:
        out, self.seconds = self.seconds, []
        return out


def fix_rope_init_for_transformers5() -> str:
    """Let qwen-tts-hf 0.1.1.post1 load its speech tokenizer on transformers 5.17.

    The package registers a "default" RoPE initializer that reads `config.rope_theta`; transformers
    5 configs such as MimiConfig keep it only in `rope_parameters`. The wrapper copies it across
    before calling the registered function. Call after `import qwen_tts`.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    registered = ROPE_INIT_FUNCTIONS.get("default")
    if registered is None or getattr(registered, "_reads_rope_parameters", False):
        return "not needed" if registered is None else "already installed"

    def default_rope(config, device=None, seq_len=None, layer_type=None):
        if getattr(config, "rope_theta", None) is None:
            params = getattr(config, "rope_parameters", None) or {}
            if layer_type is not None and isinstance(params.get(layer_type), dict):
                params = params[layer_type]
            config.rope_theta = params["rope_theta"]
        return registered(config, device, seq_len, layer_type)

    default_rope._reads_rope_parameters = True
    ROPE_INIT_FUNCTIONS["default"] = default_rope
    return "installed"


def pick_speaker(speakers: list[str] | None) -> str | None:
    """The speaker our engine uses by default ("ryan" when the checkpoint has it)."""
    if not speakers:
        return None
    return "ryan" if "ryan" in speakers else min(speakers)


def peak_memory_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def frames_of(samples: int) -> int:
    return samples // SAMPLES_PER_FRAME

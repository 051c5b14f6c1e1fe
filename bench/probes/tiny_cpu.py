"""What the CPU probes (`stream_objects.py`, `turn_cycles.py`, `turn_work.py`, `seed_rows.py`)
share: a tiny random CustomVoice checkpoint (EOS row zeroed) in a temporary folder, its engine on
the CPU, one async measurement, and its result printed as one JSON line; and a count of the torch
operations a thread dispatches."""

from __future__ import annotations

import asyncio
import collections
import json
import tempfile
from collections.abc import Awaitable, Callable

from torch.utils._python_dispatch import TorchDispatchMode

from pipecat_qwen_fast.checkpoints.build import build_checkpoint
from pipecat_qwen_fast.engine.engine import QwenTTSEngine


def print_measured(measure: Callable[[QwenTTSEngine, str], Awaitable[dict]]) -> None:
    """`measure(engine, checkpoint_folder)` on the tiny CPU engine; its dict printed as JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(tmp, size="tiny", variant="custom_voice", zero_eos=True)
        engine = QwenTTSEngine.from_pretrained(tmp, device="cpu", dtype="float32", backend="torch",
                                               progress=False)
        try:
            print(json.dumps(asyncio.run(measure(engine, tmp))))
        finally:
            engine.close()


class CountOps(TorchDispatchMode):
    """Torch operations dispatched in the thread that entered it (modes are per thread), counted
    under `window`, which the probe may switch as it goes. Each is a kernel launch or more on a
    GPU."""

    def __init__(self, window: str = "all") -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.window = window

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.window] += 1
        return func(*args, **(kwargs or {}))

"""What the CPU object probes (`stream_objects.py`, `turn_cycles.py`) share: a tiny random
CustomVoice checkpoint (EOS row zeroed) in a temporary folder, its engine on the CPU, one async
measurement, and its result printed as one JSON line."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Awaitable, Callable

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

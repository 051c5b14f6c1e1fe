"""The engine core: `QwenTTSEngine` (engine.py) and `EngineService` (service.py), no framework
imports. The names below resolve lazily, so `pipecat_qwen_fast.engine.request` and the others
import without loading the whole engine."""

from __future__ import annotations

from typing import Any

_LAZY = {
    "QwenTTSEngine": "engine",
    "AudioChunk": "request",
    "SynthesisRequest": "request",
    "SynthesisResult": "request",
    "Session": "session",
    "EngineService": "service",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

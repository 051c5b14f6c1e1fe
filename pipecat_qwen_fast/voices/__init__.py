"""Voice cloning for Base models: reference audio in, reusable voices out (see library.py).

Exports resolve lazily, so the CLI can register its `voice` command without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipecat_qwen_fast.voices.library import VoiceLibrary
    from pipecat_qwen_fast.voices.voice import Voice, load_voice

__all__ = ["Voice", "VoiceLibrary", "load_voice"]

_LAZY = {"Voice": ".voice", "load_voice": ".voice", "VoiceLibrary": ".library"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""pipecat-qwen-fast: fast self-hosted Qwen3-TTS for voice agents.

The engine core (`QwenTTSEngine`) has no framework imports. Exports are resolved lazily so that
`import pipecat_qwen_fast` works without pipecat installed and without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    ConfigError,
    EngineClosedError,
    InvalidInputError,
    ModelLoadError,
    QwenTTSError,
    UnsupportedFeatureError,
)

if TYPE_CHECKING:
    from .engine import AudioChunk, QwenTTSEngine, Session, SynthesisRequest, SynthesisResult
    from .prompt import VoiceClonePrompt
    from .sampling import SamplingParams
    from .service import EngineService, close_shared_services, get_shared_service, shared_service
    from .tts import QwenFastTTSService, QwenFastTTSSettings

__version__ = "0.1.0"

__all__ = [
    "AudioChunk",
    "ConfigError",
    "EngineClosedError",
    "EngineService",
    "InvalidInputError",
    "ModelLoadError",
    "QwenFastTTSService",
    "QwenFastTTSSettings",
    "QwenTTSEngine",
    "QwenTTSError",
    "SamplingParams",
    "Session",
    "SynthesisRequest",
    "SynthesisResult",
    "UnsupportedFeatureError",
    "VoiceClonePrompt",
    "__version__",
    "close_shared_services",
    "get_shared_service",
    "shared_service",
]

# Lazy exports: importing the package (e.g. for its errors) loads neither torch nor pipecat.
_LAZY = {
    "AudioChunk": ".engine",
    "QwenTTSEngine": ".engine",
    "Session": ".engine",
    "SynthesisRequest": ".engine",
    "SynthesisResult": ".engine",
    "VoiceClonePrompt": ".prompt",
    "SamplingParams": ".sampling",
    "QwenFastTTSService": ".tts",
    "QwenFastTTSSettings": ".tts",
    "EngineService": ".service",
    "close_shared_services": ".service",
    "get_shared_service": ".service",
    "shared_service": ".service",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""pipecat-qwen-fast: fast self-hosted Qwen3-TTS for voice agents.

The engine core (`QwenTTSEngine`) has no framework imports. Exports are resolved lazily so that
`import pipecat_qwen_fast` works without pipecat installed and without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipecat_qwen_fast.errors import (
    ConfigError,
    EngineClosedError,
    EngineOverloadedError,
    InvalidInputError,
    ModelLoadError,
    QwenTTSError,
    UnsupportedFeatureError,
)

if TYPE_CHECKING:
    from pipecat_qwen_fast.engine.engine import QwenTTSEngine
    from pipecat_qwen_fast.engine.request import AudioChunk, SynthesisRequest, SynthesisResult
    from pipecat_qwen_fast.engine.service import (
        EngineService,
        close_shared_services,
        get_shared_service,
        shared_service,
    )
    from pipecat_qwen_fast.engine.session import Session
    from pipecat_qwen_fast.model.prompt import VoiceClonePrompt
    from pipecat_qwen_fast.model.sampling import SamplingParams
    from pipecat_qwen_fast.tts import QwenFastTTSService, QwenFastTTSSettings

__version__ = "0.1.0"

__all__ = [
    "AudioChunk",
    "ConfigError",
    "EngineClosedError",
    "EngineOverloadedError",
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
    "AudioChunk": ".engine.request",
    "QwenTTSEngine": ".engine.engine",
    "Session": ".engine.session",
    "SynthesisRequest": ".engine.request",
    "SynthesisResult": ".engine.request",
    "VoiceClonePrompt": ".model.prompt",
    "SamplingParams": ".model.sampling",
    "QwenFastTTSService": ".tts",
    "QwenFastTTSSettings": ".tts",
    "EngineService": ".engine.service",
    "close_shared_services": ".engine.service",
    "get_shared_service": ".engine.service",
    "shared_service": ".engine.service",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

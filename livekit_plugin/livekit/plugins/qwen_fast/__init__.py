# Copyright 2026 pipecat-qwen-fast authors
# SPDX-License-Identifier: Apache-2.0

"""Qwen3-TTS for LiveKit Agents, self-hosted on the pipecat-qwen-fast engine.

from livekit.plugins import qwen_fast

session = AgentSession(tts=qwen_fast.TTS(voice="ryan", language="english"), ...)
"""

from livekit.agents import Plugin

from .load import load_fnc
from .log import logger
from .models import TTSBackends, TTSLanguages, TTSModels, TTSVoices
from .tts import TTS, ChunkedStream, SynthesizeStream
from .version import __version__

__all__ = [
    "TTS",
    "ChunkedStream",
    "SynthesizeStream",
    "TTSBackends",
    "TTSLanguages",
    "TTSModels",
    "TTSVoices",
    "__version__",
    "load_fnc",
]


class QwenFastPlugin(Plugin):
    def __init__(self) -> None:
        super().__init__(__name__, __version__, __package__, logger)


Plugin.register_plugin(QwenFastPlugin())

# Cleanup docs of unexported modules
_module = dir()
NOT_IN_ALL = [m for m in _module if m not in __all__]

__pdoc__ = {}

for n in NOT_IN_ALL:
    __pdoc__[n] = False

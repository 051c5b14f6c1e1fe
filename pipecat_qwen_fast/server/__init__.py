"""The TTS server: OpenAI's speech API and vLLM-Omni's WebSocket protocol over one engine.

Needs the ``server`` extra (``pip install "pipecat-qwen-fast[server]"``). Run it with
``qwen-fast-tts serve --model ...``; deploy it on Ray Serve with :mod:`.ray_serve`.
"""

from __future__ import annotations

from .app import build_app
from .run import DrainingServer, make_server, serve
from .settings import API_KEY_ENV, ServerSettings, parse_voice_aliases

__all__ = [
    "API_KEY_ENV",
    "DrainingServer",
    "ServerSettings",
    "build_app",
    "make_server",
    "parse_voice_aliases",
    "serve",
]

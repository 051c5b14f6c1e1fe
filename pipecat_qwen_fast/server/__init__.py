"""The TTS server: OpenAI's speech API and vLLM-Omni's WebSocket protocol over one engine.

Needs the ``server`` extra (``pip install "pipecat-qwen-fast[server]"``). Run it with
``qwen-fast-tts serve --model ...``; deploy it on Ray Serve with :mod:`.ray_serve`. Names are
resolved lazily, so the CLI can register ``serve`` without importing the web framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_LAZY = {
    "build_app": ".app",
    "DrainingServer": ".run",
    "make_server": ".run",
    "serve": ".run",
    "API_KEY_ENV": ".settings",
    "ServerSettings": ".settings",
    "parse_voice_aliases": ".settings",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The optional API key.

Two header forms are accepted: ``Authorization: Bearer <key>``, which OpenAI clients send, and
``Authorization: Api-Key <key>``, which LiveKit's Qwen3TTS client (livekit-plugins-baseten) sends.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from .api_errors import ApiError

_SCHEMES = ("bearer", "api-key")


def presented_key(headers: Mapping[str, str]) -> str | None:
    scheme, _, value = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() in _SCHEMES and value.strip():
        return value.strip()
    return None


def check_api_key(headers: Mapping[str, str], expected: str | None) -> None:
    """Raise a 401 ApiError unless the headers carry the expected key (no key set: no check)."""
    if not expected:
        return
    key = presented_key(headers)
    if key is None:
        raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                       kind="authentication_error", code="missing_api_key")
    # Constant time, so the key cannot be guessed from response timing.
    if not hmac.compare_digest(key.encode(), expected.encode()):
        raise ApiError(401, "invalid API key", kind="authentication_error", code="invalid_api_key")

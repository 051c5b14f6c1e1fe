"""Engine failures as LiveKit's APIError, retryable only where another try can help."""

from __future__ import annotations

from livekit.agents import APIConnectionError, APIError

from pipecat_qwen_fast.errors import (
    EngineClosedError,
    EngineOverloadedError,
    InvalidInputError,
    QwenTTSError,
)
from pipecat_qwen_fast.remote import RemoteUnavailableError

from .log import logger


def to_api_error(e: BaseException) -> APIError:
    if isinstance(e, RemoteUnavailableError):
        # Down, restarting or full: another try (or another replica behind the URL) may serve it.
        return APIConnectionError(str(e), retryable=True)
    if isinstance(e, InvalidInputError):
        # The engine's message names the bad field and the valid choices, never the text.
        return APIError(str(e), retryable=False)
    if isinstance(e, EngineClosedError):
        # The registry replaces a dead engine on the next request, so a retry can succeed.
        return APIConnectionError(f"the Qwen3-TTS engine stopped: {e}", retryable=True)
    if isinstance(e, EngineOverloadedError):
        # Refused, not served late: a retry after the others finish, or another worker, can serve it.
        return APIConnectionError(str(e), retryable=True)
    if isinstance(e, QwenTTSError):
        return APIError(str(e), retryable=False)
    logger.error("synthesis failed: %s", type(e).__name__)
    return APIError(f"synthesis failed: {type(e).__name__}: {e}", retryable=True)

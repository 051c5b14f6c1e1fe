"""The errors a request can end with, and how engine exceptions map onto them.

Bodies follow OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``) so that
OpenAI clients raise their usual exceptions (``BadRequestError``, ...) with our message in them.
Messages name the problem and the valid choices; they never echo the text to speak.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipecat_qwen_fast import EngineClosedError, InvalidInputError

# The engine's admission control (the fleet issue) raises an error of this name when it is full;
# it is matched by name so that this module works with engines built before it existed.
OVERLOAD_ERROR_NAME = "EngineOverloadedError"


@dataclass(eq=False)  # compared and hashed by identity, as exceptions are
class ApiError(Exception):
    """A request refused or failed, with what the client is told."""

    status: int
    message: str
    kind: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return headers


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def refused(message: str, retry_after_s: float, code: str) -> ApiError:
    return ApiError(503, message, kind="server_error", code=code, retry_after_s=retry_after_s)


def is_overload(exc: BaseException) -> bool:
    return any(cls.__name__ == OVERLOAD_ERROR_NAME for cls in type(exc).__mro__)


def from_engine_error(exc: BaseException, retry_after_s: float) -> ApiError:
    """The client's view of an exception raised by the engine service for one stream."""
    if is_overload(exc):
        hint = getattr(exc, "retry_after_s", None) or getattr(exc, "retry_after", None)
        # The engine's own refusals already say that the engine is full, and how.
        message = str(exc) if str(exc).startswith("the TTS engine") else f"the TTS engine is at capacity: {exc}"
        return refused(message, float(hint or retry_after_s), "overloaded")
    if isinstance(exc, InvalidInputError):
        return bad_request(str(exc))
    if isinstance(exc, EngineClosedError):
        return refused(f"the TTS engine is unavailable: {exc}", retry_after_s, "engine_unavailable")
    return ApiError(500, f"synthesis failed ({type(exc).__name__})", kind="server_error",
                    code="engine_error")

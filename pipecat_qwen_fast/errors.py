"""Exceptions raised by the engine core.

Every error names the problem and, where there is a closed set of valid values, lists them, so
that adapters can pass the message on to the user unchanged.
"""

from __future__ import annotations


class QwenTTSError(Exception):
    """Base class of every error raised by pipecat_qwen_fast."""


class InvalidInputError(QwenTTSError, ValueError):
    """The request itself is wrong (empty text, unknown voice or language, ...).

    Retrying the same request cannot help.
    """


class UnsupportedFeatureError(InvalidInputError):
    """The request asks for something this model variant does not do (e.g. instruct on 0.6B)."""


class ConfigError(QwenTTSError, ValueError):
    """A checkpoint's config.json is missing a key or holds an invalid value."""


class ModelLoadError(QwenTTSError, OSError):
    """The model could not be found or loaded (missing folder, no network for a hub id, ...)."""


class EngineClosedError(QwenTTSError, RuntimeError):
    """The engine or its service was closed, or died after a fault; no new work is accepted."""


class NoFreeSlotError(QwenTTSError, RuntimeError):
    """Every session slot of the backend is in use; retry once a session has finished.

    The EngineService queues new streams on this error instead of failing them.
    """


class EngineOverloadedError(QwenTTSError, RuntimeError):
    """The engine is serving as many streams as it may; the request was refused rather than served
    late. Retrying after `retry_after_s` can succeed. `reason` names the EngineService setting that
    refused it ("max_streams", "max_round_ms", "max_queued_streams" or "min_slack_ms"; None for
    others)."""

    def __init__(self, message: str, retry_after_s: float = 1.0, reason: str | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason

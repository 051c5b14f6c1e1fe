"""The state one app serves from: settings, the engine service, admission, metrics, live streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from starlette.requests import HTTPConnection

from .api_errors import ApiError, refused
from .auth import check_api_key
from .inline_voices import InlineVoices
from .metrics import PlayoutClock, ServerMetrics
from .settings import ServerSettings
from .speech import VoiceBook
from .streams import AdmissionGate, AudioStream, count_live

logger = logging.getLogger("pipecat_qwen_fast.server")


class ServerContext:
    """Everything the routes share. ``service`` is set at startup when the app loads its own."""

    def __init__(self, settings: ServerSettings, service: Any = None) -> None:
        self.settings = settings
        self.service = service
        self.owns_service = service is None
        self.gate = AdmissionGate(settings.max_streams, settings.retry_after_s)
        self.live: set[AudioStream] = set()
        self.open_sockets = 0
        self.metrics = ServerMetrics(
            active=lambda: count_live(self.live, lambda s: s.active),
            queued=lambda: count_live(self.live, lambda s: s.queued),
            in_use=lambda: self.gate.in_use,
            sockets=lambda: self.open_sockets,
            capacity=settings.max_streams,
            ready=lambda: self.ready,
            service=lambda: self.service,
        )
        self._book: VoiceBook | None = None
        # One voice upload encodes at a time: it bounds the CPU/GPU taken from streams, and makes
        # "name not taken, then register" atomic against other uploads.
        self.voice_upload_lock = asyncio.Lock()
        self.inline_voices = InlineVoices()  # cloned from session.config's ref_audio

    @property
    def ready(self) -> bool:
        return self.service is not None and self.service.ready and self.service.alive \
            and not self.gate.draining

    @property
    def alive(self) -> bool:
        """False once the engine failed to load or died: a restart is the only remedy."""
        return self.service is None or self.service.alive

    def authorize(self, headers: Mapping[str, str]) -> None:
        check_api_key(headers, self.settings.api_key)

    def require_ready(self) -> Any:
        """The loaded service, or a 503 that says why there is none."""
        service = self.service
        if service is None or (service.alive and not service.ready):
            raise refused("the TTS engine is still loading; retry shortly",
                          self.settings.retry_after_s, "not_ready")
        if not service.alive:
            raise refused("the TTS engine is unavailable (failed to load or stopped); see the "
                          "server log", self.settings.retry_after_s, "engine_unavailable")
        return service

    def voice_book(self) -> VoiceBook:
        if self._book is None:
            service = self.require_ready()
            library = service.engine.voice_library if service.model_type == "base" else None
            self._book = VoiceBook(voices=service.voices, aliases=dict(self.settings.voice_aliases),
                                   languages=service.languages, library=library)
        return self._book

    def open_audio(self, request: Any, endpoint: str, clock: PlayoutClock,
                   started_at: float | None, *, text_stream: bool = False) -> AudioStream:
        service = self.require_ready()
        return AudioStream(service, request, metrics=self.metrics, endpoint=endpoint, clock=clock,
                           started_at=started_at, live=self.live, sample_rate=service.sample_rate,
                           text_stream=text_stream,
                           idle_timeout_s=self.settings.ws_idle_timeout_s)

    def count_failure(self, error: ApiError) -> None:
        """Count a request that ended in ``error`` (once, where it is answered)."""
        if error.status == 503:
            self.metrics.refusals.labels(error.code or "unavailable").inc()
        elif error.status == 401:
            self.metrics.errors.labels("unauthorized").inc()
        elif error.status < 500:
            self.metrics.errors.labels("bad_request").inc()
        else:
            self.metrics.errors.labels("engine").inc()


def context_of(connection: HTTPConnection) -> ServerContext:
    return connection.app.state.qwen_tts

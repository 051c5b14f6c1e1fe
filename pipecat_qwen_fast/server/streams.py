"""Admission (the server's bound on concurrent streams, and draining) and metered engine streams.

Both endpoints go through here: an HTTP request holds one admission slot from its start to its
last byte, a WebSocket turn from its first text to its ``session.done``. A full server refuses
rather than queues, so that a load balancer can send the call to another replica at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .api_errors import refused
from .metrics import PlayoutClock, ServerMetrics


class AdmissionGate:
    """Counts admitted streams against the bound; refuses everything once draining."""

    def __init__(self, capacity: int, retry_after_s: float) -> None:
        self.capacity = capacity
        self.retry_after_s = retry_after_s
        self.in_use = 0
        self.draining = False
        self._drain_event: asyncio.Event | None = None

    def admit(self) -> Slot:
        if self.draining:
            raise refused("the server is shutting down; retry on another server",
                          self.retry_after_s, "draining")
        if self.in_use >= self.capacity:
            raise refused(f"the server is serving its limit of {self.capacity} streams; "
                          "retry shortly", self.retry_after_s, "overloaded")
        self.in_use += 1
        return Slot(self)

    def begin_drain(self) -> None:
        """Refuse new streams from now on (call on the server's event loop)."""
        self.draining = True
        self.drain_event.set()

    @property
    def drain_event(self) -> asyncio.Event:
        # Created on first use, inside the server's running loop.
        if self._drain_event is None:
            self._drain_event = asyncio.Event()
            if self.draining:
                self._drain_event.set()
        return self._drain_event


class Slot:
    """One admitted stream; release it exactly once (later calls do nothing)."""

    def __init__(self, gate: AdmissionGate) -> None:
        self._gate: AdmissionGate | None = gate

    def release(self) -> None:
        if self._gate is not None:
            self._gate.in_use -= 1
            self._gate = None


class AudioStream:
    """One engine stream, read as int16 little-endian PCM bytes and timed into the metrics.

    ``clock`` is the listener's playout clock: an HTTP response has its own, a WebSocket turn
    shares one across its sentences. ``started_at`` is when the listener began waiting for this
    stream's first chunk (None: it was not waiting, as for a turn's later sentences). Close it
    with :meth:`aclose`, which frees the engine session (cancelling it if it has not finished)
    and counts how the stream ended.
    """

    def __init__(self, service: Any, request: Any, *, metrics: ServerMetrics, endpoint: str,
                 clock: PlayoutClock, started_at: float | None, live: set[AudioStream],
                 sample_rate: int, text_stream: bool = False,
                 idle_timeout_s: float | None = None) -> None:
        # A text stream takes its text with append()/end() while it speaks (engine_stream).
        self._stream = (service.open_text_stream(request, idle_timeout_s=idle_timeout_s)
                        if text_stream else service.open_stream(request))
        self._metrics = metrics
        self._endpoint = endpoint
        self._clock = clock
        self._started_at = started_at
        self._live = live
        self._sample_rate = sample_rate
        self._outcome: str | None = None
        self.chunks = 0
        self.bytes_sent = 0
        self.frames_sent = 0  # codec frames of the audio handed out
        live.add(self)

    @property
    def engine_stream(self) -> Any:
        return self._stream

    @property
    def seconds_sent(self) -> float:
        return self.bytes_sent / 2 / self._sample_rate

    @property
    def queued(self) -> bool:
        return not self._stream.record.opened and not self._stream.done

    @property
    def active(self) -> bool:
        return self._stream.record.opened and not self._stream.done

    async def next_pcm(self) -> bytes | None:
        """The next chunk's PCM, or None at the end; engine errors are raised as they are."""
        try:
            chunk = await anext(self._stream)
        except StopAsyncIteration:
            self._outcome = self._outcome or "completed"
            return None
        except asyncio.CancelledError:
            raise  # the request's task was cancelled (its client left): counted as cancelled at aclose()
        except BaseException:
            self._outcome = self._outcome or "failed"
            raise
        now = time.monotonic()
        seconds = len(chunk.pcm) / self._sample_rate
        endpoint = self._endpoint
        if self.chunks == 0 and self._started_at is not None:
            self._metrics.first_audio.labels(endpoint).observe(now - self._started_at)
        late = self._clock.add(now, seconds)
        if late is not None:
            self._metrics.lateness.labels(endpoint).observe(late)
            if late > 0:
                self._metrics.underruns.labels(endpoint).inc()
        self._metrics.audio_seconds.labels(endpoint).inc(seconds)
        self.chunks += 1
        self.frames_sent = chunk.frame_index + chunk.num_frames
        pcm = np.ascontiguousarray(chunk.pcm, dtype="<i2").tobytes()
        self.bytes_sent += len(pcm)
        return pcm

    async def aclose(self) -> None:
        """Free the engine session (idempotent); waits until the engine thread has closed it."""
        if self not in self._live:
            return
        self._live.discard(self)
        await self._stream.aclose()
        self._metrics.streams.labels(self._endpoint, self._outcome or "cancelled").inc()


def count_live(live: set[AudioStream], predicate: Callable[[AudioStream], bool]) -> int:
    return sum(1 for stream in list(live) if predicate(stream))

"""Streamed-text turns on the EngineService (issue 35): one engine session per turn, its text
appended from the event loop as it arrives, its audio read as for any stream.

    stream = service.open_text_stream(SynthesisRequest("", voice="ryan"))
    stream.append("Hello the")           # e.g. per LLM token
    stream.append("re, how are you?")
    stream.end()
    async for chunk in stream:           # AudioChunks, the first after the first two words
        play(chunk.pcm)
    stream.spoken_text(played_s)         # after a barge-in: the words started by then

The engine thread skips a turn that has read all its text (engine/text_session.py): it decodes
nothing for it and sleeps when no stream has work, until text arrives (`append` wakes it), a turn's
idle timeout passes, or audio decoded for a waiting turn is due.
"""

from __future__ import annotations

import time
from typing import Any

from pipecat_qwen_fast.engine.request import SynthesisRequest
from pipecat_qwen_fast.engine.service import SynthesisStream, _is_fatal
from pipecat_qwen_fast.engine.text_session import DEFAULT_IDLE_TIMEOUT_S, TextFeed, WordTiming
from pipecat_qwen_fast.errors import InvalidInputError


class TextStream(SynthesisStream):
    """A turn whose text arrives while it is spoken. `append` and `end` may be called from any
    thread (they never block on the engine); iteration, `cancel` and `aclose` as for any stream."""

    def __init__(self, service, request: SynthesisRequest, stream_id: int, feed: TextFeed) -> None:
        super().__init__(service, request, stream_id)
        self.feed = feed

    def append(self, text: str) -> None:
        """Add text (any piece: a token, a word, a sentence). TextEndedError after `end()`; text
        for a turn already over (cancelled, say) is dropped."""
        if self.feed.ended_by is None and (self.cancel_requested or self.done):
            if not isinstance(text, str):
                raise InvalidInputError(f"text must be a string, got {type(text).__name__}")
            return
        self.feed.append(text)

    def end(self) -> None:
        """The turn's text is complete: it speaks the rest, then the stream ends. Idempotent."""
        self.feed.end()

    @property
    def ended_by(self) -> str | None:
        """ "end" once `end()` was called, "idle_timeout" if the turn's idle timeout ended it."""
        return self.feed.ended_by

    def words(self) -> list[WordTiming]:
        """The turn's words read so far, each with its start time in the turn's audio."""
        return self.feed.words()

    def spoken_text(self, played_s: float) -> str:
        """The words started within the first `played_s` seconds of the turn's audio (see
        engine/text_session.py for what the times measure)."""
        return self.feed.spoken_text(played_s)


def open_text_stream(
    service, request: SynthesisRequest, idle_timeout_s: float | None
) -> TextStream:
    from pipecat_qwen_fast.engine import engine as engine_module

    engine = service._require_engine()
    if not isinstance(request, SynthesisRequest):
        raise InvalidInputError(
            f"a request must be a SynthesisRequest, got {type(request).__name__}"
        )
    feed = TextFeed(engine.tokenizer, idle_timeout_s, engine_module.MAX_SEGMENT_TOKENS)
    feed.on_text = service._wake.set
    service._opened = stream_id = next(service._ids)
    stream = TextStream(service, request, stream_id, feed)
    with service._lock:
        if not service.alive:
            raise service._closed_error()
        service._inbox.append(stream)
    service._wake.set()
    return stream


def open_sessions(engine, streams: list[SynthesisStream]) -> list[Any]:
    """Sessions for a round's new streams, in order: whole texts opened together
    (`engine.open_sessions`), each text stream on its own (`engine.open_text_session`)."""
    out: list[Any] = [None] * len(streams)
    whole = [i for i, st in enumerate(streams) if not isinstance(st, TextStream)]
    if whole:
        for i, opened in zip(whole, engine.open_sessions([streams[i].request for i in whole])):
            out[i] = opened
    for i, st in enumerate(streams):
        if isinstance(st, TextStream):
            try:
                out[i] = engine.open_text_session(
                    st.request, idle_timeout_s=st.feed.idle_timeout_s, feed=st.feed
                )
            except Exception as e:  # noqa: BLE001 - reported to that stream's caller
                out[i] = e
    return out


def can_step(service, stream: SynthesisStream) -> bool:
    """Whether the stream's session decodes a frame this round: always for a whole text; for a
    text stream only once its next frame's text is there. Audio it sends while it waits is
    posted, and a turn that ends while it waits (its text ended, or nothing to say) is finished."""
    session = stream.session
    if getattr(session, "feed", None) is None:
        return True
    try:
        sent = service._engine.poll_text(session)
    except Exception as exc:
        if _is_fatal(exc):
            raise
        service._finish(stream, exc)
        return False
    if sent is None:
        return True
    for chunk in sent:
        if stream.record.first_chunk_at is None:
            stream.record.first_chunk_at = time.monotonic()
        stream._post(chunk)
    if session.done:
        stream.record.frames_decoded = int(session.frames_decoded)
        service._finish(stream, None, reason=session.stop_reason)
    return False


def wait_timeout(service) -> float | None:
    """How long the engine thread may sleep with no work: until the first text stream needs a look
    without new text (idle timeout, or audio due); None when only new text or requests matter."""
    deadlines = [
        d
        for st in service._active
        if isinstance(st, TextStream)
        and st.session is not None
        and (d := st.feed.deadline(st.session)) is not None
    ]
    if not deadlines:
        return None
    return max(0.0, min(deadlines) - time.monotonic())


__all__ = ["DEFAULT_IDLE_TIMEOUT_S", "TextStream"]

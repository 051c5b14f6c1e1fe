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

    streams_text = True

    def open_session(self, engine) -> Any:
        prepared, self.prepared = self.prepared, None  # used once: a turn sent back to wait prepares again
        if isinstance(prepared, Exception):
            raise prepared
        return engine.open_text_session(self.request, idle_timeout_s=self.feed.idle_timeout_s, feed=self.feed,
                                        prepared=prepared)

    def prepare(self, engine) -> None:
        """What the open and the first begin can do ahead (EngineService._prepare_opens)."""
        prepare = getattr(engine, "prepare_text_session", None)
        if prepare is not None:
            self.prepared = prepare(self.request, self.feed)

    def can_step(self) -> bool:
        """Only once the next frame's text is there. Audio the turn sends while it waits is posted,
        and a turn that ends while it waits (its text ended, or nothing to say) is finished."""
        service, session = self._service, self.session
        try:
            sent = service._engine.poll_text(session)
        except Exception as exc:
            if _is_fatal(exc):
                raise
            service._finish(self, exc)
            return False
        if sent is None:
            return True
        for chunk in sent:
            self._audio_arrived(chunk.num_frames)
            self._post(chunk)
        if session.done:
            self.record.frames_decoded = int(session.frames_decoded)
            service._finish(self, None, reason=session.stop_reason)
        return False

    def wake_deadline(self) -> float | None:
        """Idle timeout, or audio due: the engine thread looks again then, even with no new text."""
        return self.feed.deadline(self.session) if self.session is not None else None

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
    return service._admit(TextStream(service, request, stream_id, feed))


__all__ = ["DEFAULT_IDLE_TIMEOUT_S", "TextStream"]

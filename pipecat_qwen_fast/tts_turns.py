"""Token mode of the Pipecat service: one engine session per assistant turn (issue 35).

With ``text_aggregation_mode=TextAggregationMode.TOKEN`` Pipecat calls ``run_tts`` once per LLM
token. The first token of a turn opens a streamed-text turn on the engine
(``EngineService.open_text_stream``, dual-track; in remote mode the server's, over one WebSocket:
``RemoteTTSClient.open_text_stream``); each token is appended to it and ``run_tts`` returns at
once; the turn's end (``flush_audio``, called by the base class when the LLM response ends) ends
its text. A task per turn moves its audio into the turn's audio context as it is
made, each chunk followed by the timestamps of the words its frames read
(``add_word_timestamps``: the base class stamps them onto ``TTSTextFrame``s, and on a barge-in
only the words whose time has come reach the assistant's context). See
engine/text_session.py for what those times measure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from loguru import logger
from pipecat.audio.utils import create_stream_resampler
from pipecat.frames.frames import Frame, TTSAudioRawFrame, TTSStoppedFrame

from pipecat_qwen_fast.engine.text_session import DEFAULT_IDLE_TIMEOUT_S
from pipecat_qwen_fast.errors import EngineClosedError, ModelLoadError, QwenTTSError


@dataclass(eq=False)
class _Turn:
    stream: Any  # engine.text_service.TextStream
    task: Any = None
    interrupted: bool = False
    ended: bool = False  # its text is complete (flush_audio)
    failed: bool = False  # its session failed: the rest of its tokens are dropped
    words_sent: int = field(default=0)


class TokenTurns:
    """Mixed into QwenFastTTSService (before TTSService): token mode's turns."""

    def _init_token_turns(self) -> None:
        self._token_turns: dict[str, _Turn] = {}
        # A turn whose LLM neither sends text nor ends this long is ended by the engine.
        self._turn_idle_timeout_s = DEFAULT_IDLE_TIMEOUT_S

    async def _run_tts_token(
        self, text: str, context_id: str
    ) -> AsyncGenerator[Frame | None, None]:
        """Append a token to its turn's engine session, opening it on the turn's first token."""
        turn = self._token_turns.get(context_id)
        if turn is not None and (turn.failed or turn.ended or turn.interrupted):
            return
        if turn is None:
            service = await self._wait_for_service()
            if service is None:
                return
            try:
                request = dataclasses.replace(self._build_request(""), text_mode="dual_track")
                stream = service.open_text_stream(request, idle_timeout_s=self._turn_idle_timeout_s)
            except QwenTTSError as e:
                self._token_turns[context_id] = _Turn(None, failed=True)
                await self._end_turn_with_error(context_id, e)
                return
            turn = self._token_turns[context_id] = _Turn(stream)
            self._streams.setdefault(context_id, set()).add(stream)
            turn.task = self.create_task(self._play_turn(turn, context_id, service.sample_rate))
        turn.stream.append(text)
        yield None  # the audio arrives through the turn's task

    async def flush_audio(self, context_id: str | None = None):
        """The turn's text is complete (the LLM response ended): the session speaks the rest."""
        turn = self._token_turns.get(context_id) if context_id else None
        if turn is not None:
            turn.ended = True
            if turn.stream is not None:
                turn.stream.end()
            if turn.task is None or turn.task.done():
                del self._token_turns[context_id]
        await super().flush_audio(context_id)

    async def on_audio_context_interrupted(self, context_id: str):
        """Barge-in: stop the turn's session before its next frame and its task."""
        turn = self._token_turns.pop(context_id, None)
        if turn is not None:
            await self._stop_turn(turn)
        await super().on_audio_context_interrupted(context_id)

    async def cleanup(self):
        for context_id in list(self._token_turns):
            await self._stop_turn(self._token_turns.pop(context_id))
        await super().cleanup()

    async def _stop_turn(self, turn: _Turn) -> None:
        turn.interrupted = True
        if turn.stream is not None:
            turn.stream.cancel()
        if turn.task is not None:
            await self.cancel_task(turn.task)

    async def _play_turn(self, turn: _Turn, context_id: str, in_rate: int) -> None:
        stream = turn.stream
        # One resampler per turn, flushed at its end; never cleared mid-way (a pause in the
        # LLM's text must not drop the samples the filter holds).
        resampler = (
            create_stream_resampler(clear_after_secs=None) if in_rate != self.sample_rate else None
        )
        error: BaseException | None = None
        try:
            async for chunk in stream:
                audio = chunk.pcm.tobytes()
                if resampler is not None:
                    audio = await resampler.resample(audio, in_rate, self.sample_rate)
                if audio:
                    await self.append_to_audio_context(
                        context_id,
                        TTSAudioRawFrame(audio, self.sample_rate, 1, context_id=context_id),
                    )
                await self._send_words(turn, context_id, chunk.frame_index + chunk.num_frames)
            if resampler is not None and (tail := await resampler.flush()):
                await self.append_to_audio_context(
                    context_id, TTSAudioRawFrame(tail, self.sample_rate, 1, context_id=context_id)
                )
            await self._send_words(turn, context_id, None)
        except QwenTTSError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - an engine fault ends this turn, reported
            logger.error(f"{self}: synthesis failed: {type(e).__name__}")
            error = e
        finally:
            # Kept until its text ends, so its later tokens are not taken for a new turn.
            if turn.ended and self._token_turns.get(context_id) is turn:
                del self._token_turns[context_id]
            streams = self._streams.get(context_id)
            if streams is not None:
                streams.discard(stream)
                if not streams:
                    del self._streams[context_id]
        if error is not None:
            turn.failed = True
            await self._end_turn_with_error(context_id, error)
        elif not turn.interrupted:
            await self._close_turn_context(context_id)

    async def _send_words(self, turn: _Turn, context_id: str, until_frame: int | None) -> None:
        """Timestamps of the turn's words read before `until_frame` (None: all read) not yet sent."""
        words = turn.stream.words()
        new = [w for w in words[turn.words_sent :] if until_frame is None or w.frame < until_frame]
        if not new:
            return
        turn.words_sent += len(new)
        await self.add_word_timestamps([(w.text, w.start_s) for w in new], context_id)

    async def _close_turn_context(self, context_id: str) -> None:
        if self.audio_context_available(context_id):
            await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
            await self.remove_audio_context(context_id)

    async def _end_turn_with_error(self, context_id: str, error: BaseException) -> None:
        """Report a turn's failure and end its audio context at once (not after the idle timeout):
        an unloadable or dead engine is permanent, a bad request (unknown voice, say) is not."""
        if isinstance(error, (ModelLoadError, EngineClosedError)):
            await self.push_error(
                f"{self}: the Qwen3-TTS engine is unavailable: {error}",
                exception=error,
                force_treat_as_permanent=True,
            )
        else:
            await self.push_error(f"{self}: {error}", exception=error)
        await self._close_turn_context(context_id)

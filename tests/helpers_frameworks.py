"""Framework-side test doubles: scripted LLMs, a capturing audio output, interruption timing.

These stand in for the *other* services of a voice pipeline (an LLM, a speaker), never for our
own code: the TTS under test always runs the real engine on a tiny random checkpoint. Each
framework's doubles are built on first use, so a run with only one framework installed can
import this module.
"""

from __future__ import annotations

import asyncio
from typing import Any


def pipecat_helpers() -> tuple[type, type, type]:
    """(PipecatScriptedLLM, PipecatInterruptGate, PipecatAudioWatch), built on first use."""
    from pipecat.frames.frames import (
        Frame,
        InterruptionFrame,
        LLMContextFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        LLMTextFrame,
        StartFrame,
        TTSAudioRawFrame,
    )
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

    class PipecatScriptedLLM(FrameProcessor):
        """Answers every LLMContextFrame with the same reply, streamed as a few text tokens."""

        def __init__(self, tokens: list[str], **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._tokens = tokens
            self.turns = 0

        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, LLMContextFrame):
                self.turns += 1
                await self.push_frame(LLMFullResponseStartFrame())
                for token in self._tokens:
                    await self.push_frame(LLMTextFrame(token))
                await self.push_frame(LLMFullResponseEndFrame())
            else:
                await self.push_frame(frame, direction)

    class PipecatInterruptGate(FrameProcessor):
        """Holds an InterruptionFrame until audio has been seen, so the barge-in lands mid-utterance.

        Frames that arrive after the interruption wait behind it, so they keep their order. Put the
        gate before the TTS and pass ``audio_seen`` to a :class:`PipecatAudioWatch` after it.
        """

        def __init__(
            self, audio_seen: asyncio.Event, timeout: float = 120.0, **kwargs: Any
        ) -> None:
            super().__init__(**kwargs)
            self._audio_seen = audio_seen
            self._timeout = timeout
            self._released = asyncio.Event()
            self._released.set()

        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            if isinstance(frame, InterruptionFrame):
                # Waiting here would stall this processor's input, and with it the text ahead of the
                # interruption; a task sends it on once audio is out.
                self._released.clear()
                self.create_task(self._release_after_audio(frame, direction))
                return
            if not isinstance(frame, StartFrame):
                await asyncio.wait_for(self._released.wait(), self._timeout)
            await super().process_frame(frame, direction)
            await self.push_frame(frame, direction)

        async def _release_after_audio(self, frame: Frame, direction: FrameDirection) -> None:
            await asyncio.wait_for(self._audio_seen.wait(), self._timeout)
            await self.push_frame(frame, direction)
            self._released.set()

    class PipecatAudioWatch(FrameProcessor):
        """Sets an event on every TTSAudioRawFrame passing downstream."""

        def __init__(self, audio_seen: asyncio.Event, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._audio_seen = audio_seen

        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                self._audio_seen.set()
            await self.push_frame(frame, direction)

    return PipecatScriptedLLM, PipecatInterruptGate, PipecatAudioWatch


def livekit_helpers() -> tuple[type, type]:
    """(ScriptedLLM, CaptureAudioOutput) for LiveKit, built lazily so Pipecat-only runs skip it."""
    from livekit import rtc
    from livekit.agents import llm, utils
    from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS
    from livekit.agents.voice import io

    class ScriptedLLMStream(llm.LLMStream):
        def __init__(self, owner: ScriptedLLM, *, chat_ctx: Any, tools: Any, conn_options: Any):
            super().__init__(owner, chat_ctx=chat_ctx, tools=tools or [], conn_options=conn_options)
            self._reply_tokens = owner.tokens

        async def _run(self) -> None:
            request_id = utils.shortuuid()
            for token in self._reply_tokens:
                self._event_ch.send_nowait(
                    llm.ChatChunk(
                        id=request_id, delta=llm.ChoiceDelta(role="assistant", content=token)
                    )
                )
                await asyncio.sleep(0)

    class ScriptedLLM(llm.LLM):
        """Replies to every turn with the same tokens."""

        def __init__(self, tokens: list[str]) -> None:
            super().__init__()
            self.tokens = tokens

        def chat(
            self,
            *,
            chat_ctx: Any,
            tools: Any = None,
            conn_options: Any = DEFAULT_API_CONNECT_OPTIONS,
            **_: Any,
        ) -> llm.LLMStream:
            return ScriptedLLMStream(
                self, chat_ctx=chat_ctx, tools=tools, conn_options=conn_options
            )

    class CaptureAudioOutput(io.AudioOutput):
        """Collects every frame and reports playout as finished at once (no real-time clock)."""

        def __init__(self) -> None:
            super().__init__(label="capture", capabilities=io.AudioOutputCapabilities(pause=False))
            self.frames: list[rtc.AudioFrame] = []
            self._segment_duration = 0.0
            self._capturing = False

        async def capture_frame(self, frame: rtc.AudioFrame) -> None:
            await super().capture_frame(frame)
            if not self._capturing:
                self._capturing = True
                self.on_playback_started(created_at=asyncio.get_running_loop().time())
            self.frames.append(frame)
            self._segment_duration += frame.duration

        def flush(self) -> None:
            super().flush()
            if self._capturing:
                self._finish(interrupted=False)

        def clear_buffer(self) -> None:
            if self._capturing:
                self._finish(interrupted=True)

        def _finish(self, *, interrupted: bool) -> None:
            self._capturing = False
            position, self._segment_duration = self._segment_duration, 0.0
            self.on_playback_finished(playback_position=position, interrupted=interrupted)

    return ScriptedLLM, CaptureAudioOutput

# Copyright 2026 pipecat-qwen-fast authors
# SPDX-License-Identifier: Apache-2.0

"""``TTS.stream()`` with streamed text (issue 35): one engine session per stream.

The text the agent pushes (LLM tokens) goes into one dual-track engine session as it arrives
(``EngineService.open_text_stream``); the first audio follows the first words, not the first
sentence, and the voice runs on through the whole reply. Each audio chunk is followed by the
timed transcript of the words its frames read (``push_timed_transcript``), which
``AgentSession(use_tts_aligned_transcript=True)`` shows in step with playback. A word's time is
the frame that reads its first token: the earliest the word can be heard, not when it is
(pipecat_qwen_fast/engine/text_session.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING

from livekit.agents import tts, utils
from livekit.agents.voice.io import TimedString

from pipecat_qwen_fast.errors import QwenTTSError

from .errors import to_api_error

if TYPE_CHECKING:
    from pipecat_qwen_fast.engine.text_service import TextStream

    from .tts import SynthesizeStream


def _push_words(
    turn: TextStream, emitter: tts.AudioEmitter, sent: int, until_frame: int | None
) -> int:
    """Timed transcript of the words read before `until_frame` (None: all read) not yet pushed;
    returns how many have been pushed."""
    new = [w for w in turn.words()[sent:] if until_frame is None or w.frame < until_frame]
    if new:
        emitter.push_timed_transcript(
            [
                TimedString((" " if w.space_before else "") + w.text, start_time=w.start_s)
                for w in new
            ]
        )
    return sent + len(new)


async def run_streamed_text(stream: SynthesizeStream, emitter: tts.AudioEmitter) -> None:
    """The stream's text into one engine session as it is pushed; its audio and timed transcript
    into `emitter` (initialized, stream=True) as one segment."""
    service = await stream._tts._ready_service()
    request = replace(stream._request, text_mode="dual_track")
    turn: TextStream | None = None
    opened = asyncio.Event()

    async def feed() -> None:
        nonlocal turn
        try:
            async for data in stream._input_ch:
                if isinstance(data, stream._FlushSentinel):
                    # The segment's text is complete (LiveKit 1.8.9 takes one segment a stream).
                    if turn is not None:
                        turn.end()
                    continue
                if turn is None:
                    turn = service.open_text_stream(request)
                    opened.set()
                    stream._mark_started()
                if turn.ended_by is None:
                    turn.append(data)
            if turn is not None:
                turn.end()
        except QwenTTSError as e:
            raise to_api_error(e) from None
        finally:
            opened.set()

    async def speak() -> None:
        await opened.wait()
        if turn is None:
            return
        emitter.start_segment(segment_id=utils.shortuuid())
        sent = 0
        try:
            async for chunk in turn:
                emitter.push(chunk.pcm.tobytes())
                sent = _push_words(turn, emitter, sent, chunk.frame_index + chunk.num_frames)
        except QwenTTSError as e:
            raise to_api_error(e) from None
        except Exception as e:  # noqa: BLE001 - an engine fault must reach LiveKit as APIError
            raise to_api_error(e) from None
        _push_words(turn, emitter, sent, None)
        emitter.end_segment()

    tasks = [
        asyncio.create_task(feed(), name="qwen_fast.feed_text"),
        asyncio.create_task(speak(), name="qwen_fast.speak_turn"),
    ]
    try:
        await asyncio.gather(*tasks)
    finally:
        if turn is not None:
            turn.cancel()
        await utils.aio.cancel_and_wait(*tasks)

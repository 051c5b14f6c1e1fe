"""LiveKit plugin's stream() with streamed text (livekit/plugins/qwen_fast/streamed.py) on the
real engine (CPU, tiny random checkpoints): one engine session per stream fed as the text is
pushed, timed transcripts, AgentSession(use_tts_aligned_transcript=True), barge-in."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

pytest.importorskip("livekit.agents")

from helpers_frameworks import livekit_helpers
from livekit.agents import APIConnectOptions, APIError
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from livekit.agents.voice import Agent, AgentSession
from livekit.plugins import qwen_fast

from pipecat_qwen_fast import InvalidInputError, SynthesisRequest
from pipecat_qwen_fast.engine.service import get_shared_service

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
TIMEOUT = 120
NO_RETRY = APIConnectOptions(max_retry=0, timeout=TIMEOUT)
TOKENS = ["You", " said", " hel", "lo", ".", " That", " is", " interest", "ing", "!"]
REPLY = "".join(TOKENS)


async def make_tts(model, **kw) -> qwen_fast.TTS:
    await asyncio.wait_for(get_shared_service(model, **CPU), TIMEOUT)
    kw.setdefault("seed", 1)
    return qwen_fast.TTS(model=model, **CPU, **kw)


async def streamed(tts, tokens, delay: float = 0.0):
    stream = tts.stream(conn_options=NO_RETRY)

    async def push() -> None:
        for token in tokens:
            stream.push_text(token)
            await asyncio.sleep(delay)
        stream.end_input()

    async with stream:
        pusher = asyncio.create_task(push())
        events = [ev async for ev in stream]
        await pusher
    return events


def test_capabilities():
    tts = qwen_fast.TTS(model="unused", **CPU)
    assert tts.capabilities.streaming and tts.capabilities.aligned_transcript
    sentences = qwen_fast.TTS(model="unused", streaming_text=False, **CPU)
    assert sentences.capabilities.streaming and not sentences.capabilities.aligned_transcript
    with pytest.raises(InvalidInputError, match="streaming_text=False"):
        qwen_fast.TTS(model="unused", text_mode="prefill", **CPU)


async def test_stream_is_one_session_with_timed_transcript(endless_model):
    tts = await make_tts(endless_model, max_frames=30)
    service = await get_shared_service(endless_model, **CPU)
    before = service.streams_opened
    events = await asyncio.wait_for(streamed(tts, TOKENS, delay=0.01), TIMEOUT)

    (record,) = service.records_since(before)
    assert record.stop_reason == "frame_cap" and record.error is None
    assert len({ev.segment_id for ev in events}) == 1 and events[-1].is_final
    got = np.concatenate([np.frombuffer(bytes(ev.frame.data), np.int16) for ev in events])
    whole = await service.synthesize(
        SynthesisRequest(REPLY, seed=1, max_frames=30, text_mode="dual_track")
    )
    assert len(got) >= len(whole)
    assert np.abs(got[: len(whole)].astype(np.int32) - whole).max() <= 1
    assert not got[len(whole) :].any()  # LiveKit's silent end-of-segment marker, if any
    timed = [t for ev in events for t in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
    assert "".join(timed) == "You said hello. That is interesting!"
    starts = [t.start_time for t in timed]
    assert starts == sorted(starts) and starts[0] == 0.0
    assert all(s == pytest.approx(round(s / 0.08) * 0.08) for s in starts)  # frame times


async def test_agent_session_with_aligned_transcript(endless_model):
    ScriptedLLM, CaptureAudioOutput = livekit_helpers()
    tts = await make_tts(endless_model, max_frames=40)
    service = await get_shared_service(endless_model, **CPU)
    # The reply's newlines: the timed transcript has its words, spaced as words, so the history
    # shows which text it came from.
    tokens = [t.replace(" That", "\n\nThat") for t in TOKENS]
    session = AgentSession(llm=ScriptedLLM(tokens), tts=tts, use_tts_aligned_transcript=True)
    output = CaptureAudioOutput()
    session.output.audio = output
    await session.start(agent=Agent(instructions="Be brief."))
    try:
        before = service.streams_opened
        await asyncio.wait_for(session.run(user_input="hello"), TIMEOUT)
        said = [
            item.text_content
            for item in session.history.items
            if getattr(item, "role", None) == "assistant"
        ]
        assert said and said[-1].strip() == "You said hello. That is interesting!"
        assert len(service.records_since(before)) == 1  # one engine session for the reply
        assert sum(f.samples_per_channel for f in output.frames) >= 40 * 1920
    finally:
        await session.aclose()


async def test_barge_in_keeps_the_words_read_so_far(endless_model):
    ScriptedLLM, CaptureAudioOutput = livekit_helpers()
    tts = await make_tts(endless_model, max_frames=400, chunk_frames=1, max_chunk_frames=None)
    service = await get_shared_service(endless_model, **CPU)
    reply = "".join(f" word{i}" for i in range(80)) + "."
    session = AgentSession(llm=ScriptedLLM(["unused"]), tts=tts, use_tts_aligned_transcript=True)
    output = CaptureAudioOutput()
    session.output.audio = output
    await session.start(agent=Agent(instructions="Be brief."))
    try:
        before = service.streams_opened
        handle = session.say(reply)
        deadline = time.monotonic() + TIMEOUT
        while (
            sum(f.samples_per_channel for f in output.frames) < 3 * 1920
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(0.01)
        await asyncio.wait_for(session.interrupt(), TIMEOUT)
        await asyncio.wait_for(handle.wait_for_playout(), TIMEOUT)
        assert handle.interrupted
        while not service.records_since(before) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        record = service.records_since(before)[-1]
        assert record.stop_reason == "cancelled"
        assert record.frames_decoded - record.frames_at_cancel <= 1
        said = [
            item.text_content
            for item in session.history.items
            if getattr(item, "role", None) == "assistant"
        ]
        words = said[-1].split() if said else []
        assert words and len(words) < 81 and reply.split()[: len(words)] == words
    finally:
        await session.aclose()


async def test_bad_voice_is_a_non_retryable_api_error(endless_model):
    tts = await make_tts(endless_model, max_frames=3, voice="nobody")
    with pytest.raises(APIError) as info:
        await asyncio.wait_for(streamed(tts, TOKENS), TIMEOUT)
    assert "nobody" in str(info.value) and info.value.retryable is False
    tts.update_options(voice="ryan")
    events = await asyncio.wait_for(streamed(tts, TOKENS), TIMEOUT)
    assert sum(ev.frame.samples_per_channel for ev in events) >= 3 * 1920

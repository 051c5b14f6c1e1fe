"""Pipecat token mode (tts_turns.py) through Pipecat's run_test harness, on the real engine (CPU):
one engine session per assistant turn fed token by token, word timestamps through the base
class, barge-in, and the whole text's audio."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

pytest.importorskip("pipecat")

from helpers_frameworks import pipecat_helpers
from pipecat.frames.frames import (
    AggregatedTextProgressFrame,
    ErrorFrame,
    InterruptionFrame,
    LLMMessagesAppendFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSUpdateSettingsFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.services.tts_service import TextAggregationMode
from pipecat.tests.utils import SleepFrame, run_test

from pipecat_qwen_fast import InvalidInputError, QwenFastTTSService, SynthesisRequest
from pipecat_qwen_fast.engine.service import get_shared_service

PipecatScriptedLLM, PipecatInterruptGate, PipecatAudioWatch = pipecat_helpers()

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
TIMEOUT = 120
TOKENS = ["You", " said", " hel", "lo", ".", " That", " is", " interest", "ing", "!"]
REPLY = "".join(TOKENS)


async def make_tts(model, **kw) -> QwenFastTTSService:
    await asyncio.wait_for(get_shared_service(model, **CPU), TIMEOUT)
    kw.setdefault("seed", 1)
    return QwenFastTTSService(
        model=model, text_aggregation_mode=TextAggregationMode.TOKEN, **CPU, **kw
    )


async def llm_turn(tts, tokens, frames=None, **kw):
    """[user aggregator, scripted LLM, tts, assistant aggregator], one user message."""
    llm = PipecatScriptedLLM(tokens)
    context = LLMContext()
    user_agg, assistant_agg = LLMContextAggregatorPair(context)
    pipeline = Pipeline([user_agg, llm, tts, assistant_agg])
    first = LLMMessagesAppendFrame(
        messages=[{"role": "user", "content": "hello robot"}], run_llm=True
    )
    down, up = await asyncio.wait_for(
        run_test(pipeline, frames_to_send=[first, *(frames or [])], start_timeout=30, **kw), TIMEOUT
    )
    assistant = [m["content"] for m in context.get_messages() if m.get("role") == "assistant"]
    return down, up, assistant


def pcm(frames) -> np.ndarray:
    return np.frombuffer(
        b"".join(f.audio for f in frames if isinstance(f, TTSAudioRawFrame)), np.int16
    )


async def test_turn_is_one_session_fed_token_by_token(endless_model):
    tts = await make_tts(endless_model, max_frames=40)
    service = await get_shared_service(endless_model, **CPU)
    before = service.streams_opened
    down, up, assistant = await llm_turn(tts, TOKENS)

    assert not [f for f in up if isinstance(f, ErrorFrame)]
    records = service.records_since(before)
    assert len(records) == 1 and records[0].stop_reason == "frame_cap"  # one engine session
    kinds = [type(f) for f in down]
    audio = [i for i, k in enumerate(kinds) if k is TTSAudioRawFrame]
    assert kinds.index(TTSStartedFrame) < audio[0] and audio[-1] < kinds.index(TTSStoppedFrame)
    # The whole reply's dual-track audio: the same session, chunks sent at other moments.
    whole = await service.synthesize(
        SynthesisRequest(REPLY, seed=1, max_frames=40, text_mode="dual_track")
    )
    got = pcm(down)
    assert len(got) == len(whole) == 40 * 1920
    assert np.abs(got.astype(np.int32) - whole.astype(np.int32)).max() <= 1
    # Word timestamps through the base class: the spoken words, in order, committed to context.
    progress = [f for f in down if isinstance(f, AggregatedTextProgressFrame)]
    assert progress and all(a.pts <= b.pts for a, b in itertools.pairwise(progress))
    assert assistant == ["You said hello. That is interesting!"]


async def test_sentence_mode_still_one_request_per_sentence(endless_model):
    tts = QwenFastTTSService(model=endless_model, seed=1, max_frames=3, **CPU)
    await asyncio.wait_for(get_shared_service(endless_model, **CPU), TIMEOUT)
    service = await get_shared_service(endless_model, **CPU)
    before = service.streams_opened
    down, up, assistant = await llm_turn(tts, TOKENS)
    assert not [f for f in up if isinstance(f, ErrorFrame)]
    assert len(service.records_since(before)) == 2  # two sentences, two requests
    assert len(pcm(down)) == 2 * 3 * 1920
    assert assistant and "interesting!" in assistant[-1]


async def test_barge_in_stops_the_turn_and_commits_what_was_spoken(endless_model):
    tts = await make_tts(endless_model, max_frames=300, chunk_frames=1, max_chunk_frames=None)
    service = await get_shared_service(endless_model, **CPU)
    audio_seen = asyncio.Event()
    long_reply = [f" word{i}" for i in range(60)] + ["."]
    llm = PipecatScriptedLLM(long_reply)
    context = LLMContext()
    user_agg, assistant_agg = LLMContextAggregatorPair(context)
    pipeline = Pipeline(
        [
            user_agg,
            llm,
            PipecatInterruptGate(audio_seen),
            tts,
            PipecatAudioWatch(audio_seen),
            assistant_agg,
        ]
    )
    frames = [
        LLMMessagesAppendFrame(messages=[{"role": "user", "content": "talk"}], run_llm=True),
        SleepFrame(sleep=0.3),
        InterruptionFrame(),  # held by the gate until audio has gone by
        SleepFrame(sleep=0.5),
    ]
    before = service.streams_opened
    _, up = await asyncio.wait_for(
        run_test(pipeline, frames_to_send=frames, start_timeout=30), TIMEOUT
    )
    assert not [f for f in up if isinstance(f, ErrorFrame)]
    (record,) = service.records_since(before)
    assert record.stop_reason == "cancelled"
    assert record.frames_decoded - record.frames_at_cancel <= 1
    assert 0 < record.frames_decoded < 300
    assistant = [m["content"] for m in context.get_messages() if m.get("role") == "assistant"]
    # What was read up to the barge-in, never the whole reply.
    spoken = " ".join(assistant).split()
    assert spoken and len(spoken) < len(long_reply)
    assert spoken == [w.strip() for w in long_reply[: len(spoken)]]
    steps = service.steps_run
    await asyncio.sleep(0.3)
    assert service.steps_run == steps


async def test_bad_voice_ends_the_turn_at_once_and_next_turn_works(endless_model):
    tts = await make_tts(
        endless_model,
        max_frames=6,
        settings=QwenFastTTSService.Settings(voice="nobody"),
        stop_frame_timeout_s=30.0,
    )
    frames = [
        SleepFrame(sleep=0.5),
        TTSUpdateSettingsFrame(delta=QwenFastTTSService.Settings(voice="serena")),
        TTSSpeakFrame("Now I am Serena."),
    ]
    started = asyncio.get_running_loop().time()
    down, up, _ = await llm_turn(tts, TOKENS, frames)
    errors = [f.error for f in up if isinstance(f, ErrorFrame)]
    assert "nobody" in errors[0], errors
    assert all("no audio" in e for e in errors[1:]), (
        errors
    )  # Pipecat's own count of silent contexts
    # The failed turn's context ended at once (not after stop_frame_timeout_s), and the speak
    # frame after it was spoken.
    assert asyncio.get_running_loop().time() - started < 25
    assert len(pcm(down)) == 6 * 1920


def test_token_mode_needs_dual_track():
    with pytest.raises(InvalidInputError, match="dual-track"):
        QwenFastTTSService(
            model="unused",
            text_mode="prefill",
            text_aggregation_mode=TextAggregationMode.TOKEN,
            **CPU,
        )

"""Pipecat QwenFastTTSService through Pipecat's own run_test harness, on the real engine (CPU)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("pipecat")

from helpers_frameworks import pipecat_helpers
from pipecat.frames.frames import (
    ErrorFrame,
    InterruptionFrame,
    LLMMessagesAppendFrame,
    MetricsFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSUpdateSettingsFrame,
)
from pipecat.metrics.metrics import TTFBMetricsData, TTSUsageMetricsData
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    LLMContextAggregatorPair,
)
from pipecat.tests.utils import SleepFrame, run_test

from pipecat_qwen_fast import QwenFastTTSService
from pipecat_qwen_fast.engine.service import get_shared_service

PipecatScriptedLLM, PipecatInterruptGate, PipecatAudioWatch = pipecat_helpers()

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
TIMEOUT = 120
FRAME_SAMPLES = 1920  # 80 ms at 24 kHz


async def make_tts(model, **kw) -> QwenFastTTSService:
    # Load before the pipeline starts so run_test's start timeout measures Pipecat, not the load.
    await asyncio.wait_for(get_shared_service(model, **CPU), TIMEOUT)
    kw.setdefault("seed", 1)
    return QwenFastTTSService(model=model, **CPU, **kw)


async def run(tts, frames, **kw):
    return await asyncio.wait_for(
        run_test(tts, frames_to_send=frames, start_timeout=30, **kw), TIMEOUT
    )


def audio_frames(frames):
    return [f for f in frames if isinstance(f, TTSAudioRawFrame)]


def assert_one_utterance_shape(down):
    """Started < audio < Stopped; only audio (and the sentence's text) between them."""
    kinds = [type(f) for f in down]
    start = kinds.index(TTSStartedFrame)
    stop = kinds.index(TTSStoppedFrame)
    audio = [i for i, k in enumerate(kinds) if k is TTSAudioRawFrame]
    assert audio and start < audio[0] and audio[-1] < stop
    between = {k.__name__ for k in kinds[start + 1 : stop]}
    assert between <= {"TTSAudioRawFrame", "TTSTextFrame", "LLMAssistantPushAggregationFrame"}, (
        between
    )


async def test_speak_frame_order_and_24k_int16_audio(endless_model):
    tts = await make_tts(endless_model, max_frames=3)
    down, up = await run(tts, [TTSSpeakFrame("Hello there.")])
    assert_one_utterance_shape(down)
    audio = audio_frames(down)
    assert all(f.sample_rate == 24000 and f.num_channels == 1 for f in audio)
    assert sum(len(f.audio) for f in audio) == 3 * FRAME_SAMPLES * 2  # int16: 2 bytes a sample
    assert not [f for f in up if isinstance(f, ErrorFrame)]


async def test_audio_is_resampled_to_16k_pipeline_rate(endless_model):
    tts = await make_tts(endless_model, max_frames=3)
    params = PipelineParams(audio_out_sample_rate=16000)
    down, _ = await run(tts, [TTSSpeakFrame("Hello there.")], pipeline_params=params)
    assert_one_utterance_shape(down)
    audio = audio_frames(down)
    assert all(f.sample_rate == 16000 and f.num_channels == 1 for f in audio)
    samples = sum(len(f.audio) for f in audio) // 2
    expected = 3 * FRAME_SAMPLES * 16000 // 24000
    assert abs(samples - expected) <= 16, samples


async def test_llm_turn_is_spoken_and_committed_to_context(finite_model):
    tts = await make_tts(finite_model, max_frames=3)
    llm = PipecatScriptedLLM(["You said hello. ", "That is ", "interesting!"])
    context = LLMContext()
    user_agg, assistant_agg = LLMContextAggregatorPair(context)
    pipeline = Pipeline([user_agg, llm, tts, assistant_agg])
    messages = [{"role": "user", "content": "hello robot"}]
    service = await get_shared_service(finite_model, **CPU)
    before = service.streams_opened
    down, up = await run(pipeline, [LLMMessagesAppendFrame(messages=messages, run_llm=True)])

    assert llm.turns == 1
    assert audio_frames(down)
    assert not [f for f in up if isinstance(f, ErrorFrame)]
    assert len(service.records_since(before)) == 2  # two sentences, two engine requests
    assistant = [m for m in context.get_messages() if m.get("role") == "assistant"]
    assert assistant and "You said hello." in str(assistant[-1]["content"])
    assert "interesting!" in str(assistant[-1]["content"])


async def test_interruption_stops_engine_within_one_frame_and_next_utterance_works(endless_model):
    # Long enough that the barge-in (a few frames of pipeline latency) lands before the cap.
    cap = 30
    tts = await make_tts(endless_model, max_frames=cap, chunk_frames=1)
    service = await get_shared_service(endless_model, **CPU)
    audio_seen = asyncio.Event()
    pipeline = Pipeline([PipecatInterruptGate(audio_seen), tts, PipecatAudioWatch(audio_seen)])
    frames = [
        TTSSpeakFrame("This sentence would go on for a long time."),
        SleepFrame(sleep=0.2),  # the text passes the gate before the interruption reaches it
        InterruptionFrame(),  # held by the gate until the first audio frame has gone by
        SleepFrame(sleep=0.3),
        TTSSpeakFrame("Short."),
    ]
    before = service.streams_opened
    down, up = await run(pipeline, frames)

    records = service.records_since(before)
    assert [r.stop_reason for r in records] == ["cancelled", "frame_cap"]
    interrupted, after = records
    assert interrupted.frames_at_cancel >= 1  # audio had been produced: truly mid-utterance
    assert interrupted.frames_decoded - interrupted.frames_at_cancel <= 1
    assert interrupted.frames_decoded < cap
    assert after.frames_decoded == cap

    kinds = [type(f) for f in down]
    cut = kinds.index(InterruptionFrame)
    assert TTSAudioRawFrame in kinds[:cut]
    assert TTSStartedFrame in kinds[cut:] and TTSStoppedFrame in kinds[cut:]
    assert sum(len(f.audio) for f in audio_frames(down[cut:])) == cap * FRAME_SAMPLES * 2
    assert not [f for f in up if isinstance(f, ErrorFrame)]


async def test_metrics_frames_carry_ttfb_and_usage(endless_model):
    tts = await make_tts(endless_model, max_frames=2)
    params = PipelineParams(enable_metrics=True, enable_usage_metrics=True)
    text = "Metrics please."
    down, _ = await run(tts, [TTSSpeakFrame(text)], pipeline_params=params)
    data = [d for f in down if isinstance(f, MetricsFrame) for d in f.data]
    ttfb = [d for d in data if isinstance(d, TTFBMetricsData)]
    usage = [d for d in data if isinstance(d, TTSUsageMetricsData)]
    assert ttfb and any(d.value > 0 for d in ttfb)
    assert [d.value for d in usage] == [len(text)]


async def test_unknown_voice_is_an_error_frame_and_service_recovers(endless_model):
    tts = await make_tts(
        endless_model,
        max_frames=2,
        settings=QwenFastTTSService.Settings(voice="nobody"),
        # A context that fails without audio is closed after this idle time, not the 10 s default.
        stop_frame_timeout_s=2.0,
    )
    frames = [
        TTSSpeakFrame("Who am I?"),
        SleepFrame(sleep=0.3),
        TTSUpdateSettingsFrame(delta=QwenFastTTSService.Settings(voice="serena")),
        TTSSpeakFrame("Now I am Serena."),
    ]
    down, up = await run(tts, frames)
    errors = [f.error for f in up if isinstance(f, ErrorFrame)]
    assert any("nobody" in e and "serena" in e for e in errors), errors
    assert sum(len(f.audio) for f in audio_frames(down)) == 2 * FRAME_SAMPLES * 2


async def test_blank_text_is_skipped_and_next_utterance_works(endless_model):
    tts = await make_tts(endless_model, max_frames=2)
    down, up = await run(tts, [TTSSpeakFrame("   "), TTSSpeakFrame("Real words.")])
    assert not [f for f in up if isinstance(f, ErrorFrame)]
    assert sum(len(f.audio) for f in audio_frames(down)) == 2 * FRAME_SAMPLES * 2


async def test_missing_model_folder_is_permanent_error_until_model_changes(tmp_path, endless_model):
    await asyncio.wait_for(get_shared_service(endless_model, **CPU), TIMEOUT)
    missing = tmp_path / "no-such-model"
    tts = QwenFastTTSService(model=missing, seed=1, max_frames=2, stop_frame_timeout_s=2.0, **CPU)
    frames = [
        TTSSpeakFrame("Anyone there?"),
        SleepFrame(sleep=0.3),
        TTSUpdateSettingsFrame(delta=QwenFastTTSService.Settings(model=str(endless_model))),
        TTSSpeakFrame("Now there is."),
    ]
    down, up = await run(tts, frames)
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    assert errors and "no-such-model" in errors[0].error
    assert sum(len(f.audio) for f in audio_frames(down)) == 2 * FRAME_SAMPLES * 2


def test_language_mapping_and_metrics_flag():
    from pipecat.transcriptions.language import Language

    tts = QwenFastTTSService(model="unused", **CPU)
    assert tts.can_generate_metrics()
    assert tts.language_to_service_language(Language.EN_US) == "english"
    assert tts.language_to_service_language(Language.ZH) == "chinese"
    assert tts.language_to_service_language(Language.JA) == "japanese"

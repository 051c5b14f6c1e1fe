"""LiveKit plugin livekit.plugins.qwen_fast on the real engine (CPU, tiny random checkpoints)."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("livekit.agents")

from helpers_frameworks import livekit_helpers
from livekit.agents import APIConnectOptions, APIError, Plugin
from livekit.agents.metrics import TTSMetrics
from livekit.agents.voice import Agent, AgentSession
from livekit.plugins import qwen_fast

from pipecat_qwen_fast.engine.service import get_shared_service

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
TIMEOUT = 120
FRAME_SAMPLES = 1920
NO_RETRY = APIConnectOptions(max_retry=0, timeout=TIMEOUT)


async def make_tts(model, **kw) -> qwen_fast.TTS:
    await asyncio.wait_for(get_shared_service(model, **CPU), TIMEOUT)
    kw.setdefault("seed", 1)
    return qwen_fast.TTS(model=model, **CPU, **kw)


def samples(events) -> int:
    return sum(ev.frame.samples_per_channel for ev in events)


def assert_frames_of_audio(events, frames: int) -> None:
    # LiveKit may end a segment with a synthetic 10 ms silent marker that carries is_final.
    got = samples(events)
    assert frames * FRAME_SAMPLES <= got <= frames * FRAME_SAMPLES + 240, got


def test_plugin_is_registered_and_typed():
    import importlib.resources

    assert any(p.package == "livekit.plugins.qwen_fast" for p in Plugin.registered_plugins)
    assert importlib.resources.files("livekit.plugins.qwen_fast").joinpath("py.typed").is_file()
    assert qwen_fast.__version__
    tts = qwen_fast.TTS(model="unused", **CPU)
    assert tts.capabilities.streaming and tts.sample_rate == 24000 and tts.num_channels == 1
    assert tts.provider == "qwen-fast" and tts.model == "unused"


async def test_synthesize_events_share_request_id_and_only_last_is_final(endless_model):
    tts = await make_tts(endless_model, max_frames=8)
    metrics: list[TTSMetrics] = []
    tts.on("metrics_collected", metrics.append)
    events = await asyncio.wait_for(
        _collect(tts.synthesize("Hello there.", conn_options=NO_RETRY)), TIMEOUT
    )

    assert events
    request_ids = {ev.request_id for ev in events}
    assert len(request_ids) == 1 and request_ids != {""}
    assert [ev.is_final for ev in events] == [False] * (len(events) - 1) + [True]
    assert all(ev.frame.sample_rate == 24000 and ev.frame.num_channels == 1 for ev in events)
    assert_frames_of_audio(events, 8)
    await asyncio.sleep(0)
    assert len(metrics) == 1
    assert metrics[0].ttfb > 0 and metrics[0].characters_count == len("Hello there.")
    assert 8 * 0.08 - 1e-6 <= metrics[0].audio_duration <= 8 * 0.08 + 0.011
    await tts.aclose()


async def _collect(stream):
    async with stream:
        return [ev async for ev in stream]


async def test_stream_flush_closes_a_segment_spoken_sentence_by_sentence(endless_model, caplog):
    """With streaming_text=False, each flush closes one segment; sentences inside a segment are
    separate engine requests (streamed text: tests/test_livekit_streamed.py).

    LiveKit 1.8.9 accepts one segment per SynthesizeStream: text pushed after the first flush is
    dropped by the framework (with a deprecation warning) before it reaches the plugin. The
    second flush below checks that the plugin then still emits exactly the segments LiveKit
    counted, so the base class's "number of segments mismatch" check passes.
    """
    tts = await make_tts(endless_model, max_frames=4, streaming_text=False)
    service = await get_shared_service(endless_model, **CPU)
    metrics: list[TTSMetrics] = []
    tts.on("metrics_collected", metrics.append)
    before = service.streams_opened

    stream = tts.stream(conn_options=NO_RETRY)
    for token in ["The first sentence ", "is right here. ", "And here is ", "the second one."]:
        stream.push_text(token)
    stream.flush()
    stream.push_text("A second segment, which LiveKit 1.8.9 drops.")
    stream.flush()
    stream.end_input()
    events = await asyncio.wait_for(_collect(stream), TIMEOUT)

    segment_ids = {ev.segment_id for ev in events}
    assert len(segment_ids) == 1 and segment_ids != {""}
    assert len({ev.request_id for ev in events}) == 1
    assert [ev.is_final for ev in events][-1] is True
    assert sum(ev.is_final for ev in events) == 1
    assert "multiple segments in a single instance is deprecated" in caplog.text
    # Sentence tokenization inside the segment: two engine requests of 4 frames each.
    assert [r.frames_decoded for r in service.records_since(before)] == [4, 4]
    assert_frames_of_audio(events, 8)
    assert len(metrics) == 1 and metrics[0].streamed and metrics[0].segment_id in segment_ids
    await tts.aclose()


async def test_agent_session_speaks_scripted_reply(finite_model):
    ScriptedLLM, CaptureAudioOutput = livekit_helpers()
    tts = await make_tts(finite_model, max_frames=10)
    metrics: list[TTSMetrics] = []
    tts.on("metrics_collected", metrics.append)
    session = AgentSession(llm=ScriptedLLM(["Hi there! ", "Nice to ", "meet you."]), tts=tts)
    output = CaptureAudioOutput()
    session.output.audio = output
    await session.start(agent=Agent(instructions="Be brief."))
    try:
        result = session.run(user_input="hello")
        await asyncio.wait_for(result, TIMEOUT)
        assert output.frames and sum(f.samples_per_channel for f in output.frames) > 0
        assert all(f.sample_rate == 24000 for f in output.frames)
        said = [
            item.text_content
            for item in session.history.items
            if getattr(item, "role", None) == "assistant"
        ]
        assert said and "Nice to meet you." in said[-1]
        assert metrics and all(m.ttfb > 0 for m in metrics)
    finally:
        await session.aclose()


async def test_session_interrupt_stops_engine_within_one_frame(endless_model):
    ScriptedLLM, CaptureAudioOutput = livekit_helpers()
    tts = await make_tts(endless_model, max_frames=300, chunk_frames=1)
    service = await get_shared_service(endless_model, **CPU)
    session = AgentSession(llm=ScriptedLLM(["unused"]), tts=tts)
    output = CaptureAudioOutput()
    session.output.audio = output
    await session.start(agent=Agent(instructions="Be brief."))
    try:
        before = service.streams_opened
        handle = session.say("This would be a very long thing to say if nobody stopped it.")
        deadline = time.monotonic() + TIMEOUT
        while not output.frames and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert output.frames, "no audio before the interruption"
        await asyncio.wait_for(session.interrupt(), TIMEOUT)
        await asyncio.wait_for(handle.wait_for_playout(), TIMEOUT)
        assert handle.interrupted

        # The history is bounded, so its length cannot tell whether this stream's record is in.
        while not service.records_since(before) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        records = service.records_since(before)
        assert records, "the interrupted stream never closed"
        record = records[-1]
        assert record.stop_reason == "cancelled"
        assert record.frames_decoded - record.frames_at_cancel <= 1
        assert record.frames_decoded < 300
        steps = service.steps_run
        await asyncio.sleep(0.3)
        assert service.steps_run == steps
    finally:
        await session.aclose()


@pytest.mark.parametrize(
    ("text", "options", "expected"),
    [
        ("   ", {}, "empty"),
        ("Hello there.", {"voice": "nobody"}, "nobody"),
    ],
    ids=["empty-text", "unknown-voice"],
)
async def test_bad_request_is_non_retryable_api_error(endless_model, text, options, expected):
    tts = await make_tts(endless_model, max_frames=3, **options)
    errors = []
    tts.on("error", errors.append)
    with pytest.raises(APIError) as info:
        await asyncio.wait_for(_collect(tts.synthesize(text)), TIMEOUT)
    assert expected in str(info.value) and info.value.retryable is False
    assert errors and errors[-1].recoverable is False
    # The same TTS keeps working for the next (good) request.
    tts.update_options(voice="ryan")
    events = await asyncio.wait_for(_collect(tts.synthesize("Fine now.")), TIMEOUT)
    assert_frames_of_audio(events, 3)


async def test_missing_model_folder_is_non_retryable_and_tts_recovers(tmp_path, endless_model):
    await asyncio.wait_for(get_shared_service(endless_model, **CPU), TIMEOUT)
    tts = qwen_fast.TTS(model=tmp_path / "no-such-model", seed=1, max_frames=3, **CPU)
    tts.prewarm()
    with pytest.raises(APIError) as info:
        await asyncio.wait_for(_collect(tts.synthesize("Anyone there?")), TIMEOUT)
    assert "no-such-model" in str(info.value) and info.value.retryable is False
    tts.update_options(model=str(endless_model))
    events = await asyncio.wait_for(_collect(tts.synthesize("Now there is.")), TIMEOUT)
    assert_frames_of_audio(events, 3)

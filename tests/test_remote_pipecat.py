"""Pipecat QwenFastTTSService in remote mode (base_url) against the real server on loopback, over
the same tiny CPU engine the in-process service uses (tests/server/conftest.py's `running`)."""

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
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.services.tts_service import TextAggregationMode
from pipecat.tests.utils import SleepFrame, run_test
from server.conftest import eventually, running, settings_for, settled

from pipecat_qwen_fast import QwenFastTTSService, SynthesisRequest
from pipecat_qwen_fast.bench.server_latency import free_port
from pipecat_qwen_fast.engine.service import get_shared_service
from pipecat_qwen_fast.errors import InvalidInputError
from pipecat_qwen_fast.remote import stream_url

PipecatScriptedLLM, PipecatInterruptGate, PipecatAudioWatch = pipecat_helpers()

pytestmark = pytest.mark.timeout(240)

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
TIMEOUT = 120


@pytest.fixture
async def srv(endless_model):
    # The server serves the very engine the in-process service uses: one load, same weights.
    service = await asyncio.wait_for(get_shared_service(endless_model, **CPU), TIMEOUT)
    with running(settings_for(endless_model), service) as server:
        yield server


async def run(tts, frames):
    return await asyncio.wait_for(
        run_test(tts, frames_to_send=frames, start_timeout=30), TIMEOUT
    )


def audio(frames) -> bytes:
    return b"".join(f.audio for f in frames if isinstance(f, TTSAudioRawFrame))


async def test_remote_audio_equals_in_process(srv, endless_model):
    frames = [TTSSpeakFrame("Hello there, this is a test.")]
    local = QwenFastTTSService(model=endless_model, **CPU, seed=5, max_frames=10)
    down_local, up_local = await run(local, frames)
    remote = QwenFastTTSService(base_url=f"ws://127.0.0.1:{srv.port}", seed=5, max_frames=10)
    assert remote.engine_service is None  # no model loaded in this process
    await asyncio.wait_for(remote.wait_ready(), TIMEOUT)
    assert remote.ready
    down_remote, up_remote = await run(remote, frames)
    assert not [f for f in up_local + up_remote if isinstance(f, ErrorFrame)]
    assert len(audio(down_local)) == 10 * 1920 * 2
    assert audio(down_remote) == audio(down_local)
    await eventually(lambda: settled(srv), 10, "the server to settle")


async def test_remote_interruption_cancels_the_servers_stream(srv, endless_model):
    cap = 60
    service = await get_shared_service(endless_model, **CPU)
    tts = QwenFastTTSService(base_url=srv.ws_url, seed=1, max_frames=cap)
    audio_seen = asyncio.Event()
    pipeline = Pipeline([PipecatInterruptGate(audio_seen), tts, PipecatAudioWatch(audio_seen)])
    frames = [
        TTSSpeakFrame("This sentence would go on for a long time."),
        SleepFrame(sleep=0.2),
        InterruptionFrame(),  # held by the gate until the first audio frame has gone by
        SleepFrame(sleep=0.5),
    ]
    before = service.streams_opened
    down, up = await run(pipeline, frames)
    await eventually(lambda: settled(srv), 5, "the server's stream to end after the barge-in")
    records = service.records_since(before)
    assert [r.stop_reason for r in records] == ["cancelled"]
    (interrupted,) = records
    assert interrupted.frames_at_cancel >= 1  # cut mid-utterance, after audio had been made
    assert interrupted.frames_decoded - interrupted.frames_at_cancel <= 1
    assert interrupted.frames_decoded < cap
    assert not [f for f in up if isinstance(f, ErrorFrame)]
    kinds = [type(f) for f in down]
    assert TTSAudioRawFrame in kinds[: kinds.index(InterruptionFrame)]


async def test_remote_server_down_is_a_clear_error_frame():
    tts = QwenFastTTSService(base_url=f"ws://127.0.0.1:{free_port()}")
    down, up = await run(tts, [TTSSpeakFrame("Hello.")])
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    assert errors and "cannot reach the TTS server" in errors[0].error
    assert not errors[0].fatal  # the server may be back for the next sentence
    assert not audio(down)


@pytest.mark.parametrize("schedule, sizes", [
    # Fixed 2-frame chunks (max_chunk_frames None is sent as a cap of chunk_frames).
    ({"first_chunk_frames": 2, "chunk_frames": 2, "max_chunk_frames": None}, [2, 2, 2, 2, 1]),
    ({"chunk_frames": 2, "chunk_growth": 2}, [1, 2, 4, 2]),  # 1, 2, 4, ...: not the default
])
async def test_remote_sends_greedy_and_the_chunk_schedule(srv, endless_model, schedule, sizes):
    """Options beyond vLLM-Omni's fields travel as the server's extensions: the same audio as
    in-process, chunk by chunk."""
    options = {"greedy": True, "max_frames": 9, **schedule}
    frames = [TTSSpeakFrame("Greedy and in fixed chunks.")]
    local = QwenFastTTSService(model=endless_model, **CPU, **options)
    down_local, _ = await run(local, frames)
    remote = QwenFastTTSService(base_url=srv.ws_url, **options)
    down_remote, up = await run(remote, frames)
    assert not [f for f in up if isinstance(f, ErrorFrame)]
    assert len(audio(down_local)) == 9 * 1920 * 2
    assert audio(down_remote) == audio(down_local)
    assert [len(f.audio) // 2 // 1920 for f in down_remote if isinstance(f, TTSAudioRawFrame)] == sizes


TOKENS = ["You", " said", " hel", "lo", ".", " That", " is", " interest", "ing", "!"]


async def test_remote_token_mode_streams_the_turn_to_the_server(srv, endless_model):
    """Token mode over the server: the turn's tokens go out as they come, one engine session on
    the server speaks them, and the word times come back for Pipecat's word timestamps."""
    service = await get_shared_service(endless_model, **CPU)
    tts = QwenFastTTSService(base_url=srv.ws_url, seed=1, max_frames=40,
                             text_aggregation_mode=TextAggregationMode.TOKEN)
    context = LLMContext()
    user_agg, assistant_agg = LLMContextAggregatorPair(context)
    pipeline = Pipeline([user_agg, PipecatScriptedLLM(TOKENS), tts, assistant_agg])
    first = LLMMessagesAppendFrame(messages=[{"role": "user", "content": "hi"}], run_llm=True)
    before = service.streams_opened
    down, up = await asyncio.wait_for(
        run_test(pipeline, frames_to_send=[first], start_timeout=30), TIMEOUT)
    assert not [f for f in up if isinstance(f, ErrorFrame)]
    await eventually(lambda: settled(srv), 10, "the server to settle")
    (record,) = service.records_since(before)  # one engine session for the turn
    assert record.stop_reason == "frame_cap"
    whole = await service.synthesize(
        SynthesisRequest("".join(TOKENS), seed=1, max_frames=40, text_mode="dual_track"))
    got = np.frombuffer(audio(down), np.int16)
    assert len(got) == len(whole) == 40 * 1920
    assert np.abs(got.astype(np.int32) - whole.astype(np.int32)).max() <= 1
    progress = [f for f in down if isinstance(f, AggregatedTextProgressFrame)]
    assert progress and all(a.pts <= b.pts for a, b in itertools.pairwise(progress))
    assistant = [m["content"] for m in context.get_messages() if m.get("role") == "assistant"]
    assert assistant == ["You said hello. That is interesting!"]


async def test_remote_token_mode_barge_in_cancels_the_servers_session(srv, endless_model):
    service = await get_shared_service(endless_model, **CPU)
    tts = QwenFastTTSService(base_url=srv.ws_url, seed=1, max_frames=300, chunk_frames=1,
                             max_chunk_frames=None, text_aggregation_mode=TextAggregationMode.TOKEN)
    audio_seen = asyncio.Event()
    reply = [f" word{i}" for i in range(60)] + ["."]
    context = LLMContext()
    user_agg, assistant_agg = LLMContextAggregatorPair(context)
    pipeline = Pipeline([user_agg, PipecatScriptedLLM(reply), PipecatInterruptGate(audio_seen),
                         tts, PipecatAudioWatch(audio_seen), assistant_agg])
    frames = [
        LLMMessagesAppendFrame(messages=[{"role": "user", "content": "talk"}], run_llm=True),
        SleepFrame(sleep=0.3),
        InterruptionFrame(),  # held by the gate until audio has gone by
        SleepFrame(sleep=0.5),
    ]
    before = service.streams_opened
    _, up = await run(pipeline, frames)
    assert not [f for f in up if isinstance(f, ErrorFrame)]
    await eventually(lambda: settled(srv), 10, "the server's session to end after the barge-in")
    (record,) = service.records_since(before)
    assert record.stop_reason == "cancelled"
    assert 0 < record.frames_decoded < 300
    assistant = [m["content"] for m in context.get_messages() if m.get("role") == "assistant"]
    spoken = " ".join(assistant).split()  # the words timed before the barge-in, in order
    assert spoken and len(spoken) < len(reply)
    assert spoken == [w.strip() for w in reply[: len(spoken)]]


def test_remote_refuses_what_the_server_cannot_take():
    with pytest.raises(InvalidInputError, match="chunk_frames must be at most 32"):
        QwenFastTTSService(base_url="ws://127.0.0.1:1", chunk_frames=64)
    with pytest.raises(InvalidInputError, match="dual-track"):
        QwenFastTTSService(base_url="ws://127.0.0.1:1", text_mode="prefill",
                           text_aggregation_mode=TextAggregationMode.TOKEN)
    # Token mode and greedy are served remotely too.
    QwenFastTTSService(base_url="ws://127.0.0.1:1", greedy=True,
                       text_aggregation_mode=TextAggregationMode.TOKEN)
    with pytest.raises(InvalidInputError, match="base_url"):
        QwenFastTTSService(base_url="tcp://127.0.0.1:1")
    assert stream_url("http://h:1") == "ws://h:1/v1/audio/speech/stream"
    assert stream_url("wss://h/v1/audio/speech/stream") == "wss://h/v1/audio/speech/stream"

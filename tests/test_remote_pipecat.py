"""Pipecat QwenFastTTSService in remote mode (base_url) against the real server on loopback, over
the same tiny CPU engine the in-process service uses (tests/server/conftest.py's `running`)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("pipecat")

from helpers_frameworks import pipecat_helpers
from pipecat.frames.frames import (
    ErrorFrame,
    InterruptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.services.tts_service import TextAggregationMode
from pipecat.tests.utils import SleepFrame, run_test
from server.conftest import eventually, running, settings_for, settled

from pipecat_qwen_fast import QwenFastTTSService
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


def test_remote_refuses_what_the_protocol_cannot_carry():
    with pytest.raises(InvalidInputError, match="greedy"):
        QwenFastTTSService(base_url="ws://127.0.0.1:1", greedy=True)
    with pytest.raises(InvalidInputError, match="token mode"):
        QwenFastTTSService(base_url="ws://127.0.0.1:1", text_aggregation_mode=TextAggregationMode.TOKEN)
    with pytest.raises(InvalidInputError, match="base_url"):
        QwenFastTTSService(base_url="tcp://127.0.0.1:1")
    assert stream_url("http://h:1") == "ws://h:1/v1/audio/speech/stream"
    assert stream_url("wss://h/v1/audio/speech/stream") == "wss://h/v1/audio/speech/stream"

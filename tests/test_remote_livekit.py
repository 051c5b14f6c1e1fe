"""LiveKit qwen_fast.TTS in remote mode (base_url) and qwen_fast.load_fnc, against the real server
on loopback over the same tiny CPU engine the in-process TTS uses (tests/server/conftest.py)."""

from __future__ import annotations

import asyncio
import inspect

import numpy as np
import pytest

pytest.importorskip("livekit.agents")

from livekit.agents import APIConnectionError, APIConnectOptions
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from livekit.plugins import qwen_fast
from server.conftest import eventually, running, settings_for, settled

from pipecat_qwen_fast import SynthesisRequest
from pipecat_qwen_fast.bench.server_latency import free_port
from pipecat_qwen_fast.engine.service import get_shared_service

pytestmark = pytest.mark.timeout(240)

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
TIMEOUT = 120
NO_RETRY = APIConnectOptions(max_retry=0, timeout=TIMEOUT)
MAX_STREAMS = 4


@pytest.fixture
async def srv(endless_model):
    # The server serves the very engine the in-process TTS uses: one load, same weights.
    service = await asyncio.wait_for(get_shared_service(endless_model, **CPU), TIMEOUT)
    with running(settings_for(endless_model, max_streams=MAX_STREAMS), service) as server:
        yield server


async def pcm_of(stream) -> bytes:
    async with stream:
        return b"".join([bytes(ev.frame.data) async for ev in stream])


async def streamed(tts, text: str) -> bytes:
    stream = tts.stream(conn_options=NO_RETRY)
    stream.push_text(text)
    stream.end_input()
    return await asyncio.wait_for(pcm_of(stream), TIMEOUT)


async def streamed_events(tts, tokens: list[str]) -> list:
    stream = tts.stream(conn_options=NO_RETRY)

    async def push() -> None:
        for token in tokens:
            stream.push_text(token)
            await asyncio.sleep(0.01)
        stream.end_input()

    async with stream:
        pusher = asyncio.create_task(push())
        events = await asyncio.wait_for(_collect(stream), TIMEOUT)
        await pusher
    return events


async def _collect(stream) -> list:
    return [ev async for ev in stream]


async def test_remote_audio_equals_in_process(srv, endless_model):
    text = "Hello there, this is a test."
    local = qwen_fast.TTS(model=endless_model, **CPU, seed=7, max_frames=10, streaming_text=False)
    remote = qwen_fast.TTS(base_url=f"ws://127.0.0.1:{srv.port}", seed=7, max_frames=10,
                           streaming_text=False)
    assert remote.engine_service is None and not remote.capabilities.aligned_transcript
    want = await asyncio.wait_for(pcm_of(local.synthesize(text, conn_options=NO_RETRY)), TIMEOUT)
    assert len(want) >= 10 * 1920 * 2
    got = await asyncio.wait_for(pcm_of(remote.synthesize(text, conn_options=NO_RETRY)), TIMEOUT)
    assert got == want
    assert await streamed(remote, text) == await streamed(local, text)
    assert remote.engine_service is None
    await local.aclose()
    await remote.aclose()
    await eventually(lambda: settled(srv), 10, "the server to settle")


async def test_remote_streamed_text_is_one_server_turn_with_its_timed_transcript(srv,
                                                                              endless_model):
    """stream() with streaming_text (the default) in remote mode: the pushed text goes to the
    server as it comes, one engine session speaks it, and the timed transcript is the in-process
    one."""
    tokens = ["You", " said", " hel", "lo", ".", " That", " is", " interest", "ing", "!"]
    service = await get_shared_service(endless_model, **CPU)
    local = qwen_fast.TTS(model=endless_model, **CPU, seed=1, max_frames=30)
    remote = qwen_fast.TTS(base_url=srv.ws_url, seed=1, max_frames=30)
    assert remote.capabilities.aligned_transcript
    before = service.streams_opened
    got = await streamed_events(remote, tokens)
    await eventually(lambda: settled(srv), 10, "the server to settle")
    (record,) = service.records_since(before)
    assert record.stop_reason == "frame_cap"
    want = await streamed_events(local, tokens)
    whole = await service.synthesize(
        SynthesisRequest("".join(tokens), seed=1, max_frames=30, text_mode="dual_track"))
    for events in (got, want):
        assert len({ev.segment_id for ev in events}) == 1 and events[-1].is_final
        pcm = np.concatenate([np.frombuffer(bytes(ev.frame.data), np.int16) for ev in events])
        assert len(pcm) >= len(whole) and not pcm[len(whole):].any()
        assert np.abs(pcm[: len(whole)].astype(np.int32) - whole).max() <= 1

    def timed(events):
        return [(str(t), t.start_time) for ev in events
                for t in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]

    assert timed(got) == timed(want)
    assert "".join(t for t, _ in timed(got)) == "You said hello. That is interesting!"
    await local.aclose()
    await remote.aclose()


@pytest.mark.parametrize("how", ["synthesize", "streamed-text"])
async def test_remote_stream_closed_mid_audio_cancels_the_servers_stream(srv, endless_model, how):
    cap = 200
    service = await get_shared_service(endless_model, **CPU)
    tts = qwen_fast.TTS(base_url=srv.ws_url, seed=1, max_frames=cap)
    before = service.streams_opened
    text = "This sentence would go on for a long time."
    if how == "synthesize":
        stream = tts.synthesize(text, conn_options=NO_RETRY)
    else:  # its text still coming when it is closed
        stream = tts.stream(conn_options=NO_RETRY)
        stream.push_text(text)
    got = 0
    async for ev in stream:
        got += ev.frame.samples_per_channel
        if got >= 1920:
            break
    await stream.aclose()
    await eventually(lambda: settled(srv), 5, "the server's stream to end after the close")
    (record,) = service.records_since(before)
    assert record.stop_reason == "cancelled"
    assert record.frames_decoded < cap
    await tts.aclose()


async def test_remote_server_down_is_a_retryable_connection_error():
    tts = qwen_fast.TTS(base_url=f"ws://127.0.0.1:{free_port()}")
    with pytest.raises(APIConnectionError, match="cannot reach the TTS server") as info:
        await asyncio.wait_for(pcm_of(tts.synthesize("Hello.", conn_options=NO_RETRY)), TIMEOUT)
    assert info.value.retryable
    await tts.aclose()


async def test_load_fnc_remote_reads_the_servers_streams(srv):
    tts = qwen_fast.TTS(base_url=srv.base_url, seed=1, max_frames=200)
    load = qwen_fast.load_fnc(tts)
    # LiveKit calls a load_fnc with no parameter with no argument, in a thread.
    assert not inspect.signature(load).parameters
    assert await asyncio.to_thread(load) == 0.0
    stream = tts.synthesize("This sentence would go on for a long time.", conn_options=NO_RETRY)
    async for _ev in stream:
        assert await asyncio.to_thread(load) == 1 / MAX_STREAMS
        break
    await stream.aclose()
    await eventually(lambda: settled(srv), 5, "the server to settle")
    assert await asyncio.to_thread(qwen_fast.load_fnc(base_url=srv.ws_url)) == 0.0
    down = qwen_fast.load_fnc(base_url=f"http://127.0.0.1:{free_port()}", timeout_s=1.0)
    assert await asyncio.to_thread(down) == 1.0  # unreachable: full, so no job comes here
    await tts.aclose()


async def test_load_fnc_in_process_counts_the_engines_streams(endless_model):
    tts = qwen_fast.TTS(model=endless_model, **CPU, seed=1, max_frames=200)
    load = qwen_fast.load_fnc(tts, capacity=4)
    assert load() == 0.0  # nothing loaded by this TTS yet
    tts.prewarm()
    await asyncio.wait_for(tts.engine_service.wait_ready(), TIMEOUT)
    assert load() == 0.0
    stream = tts.synthesize("This sentence would go on for a long time.", conn_options=NO_RETRY)
    async for _ev in stream:
        assert load() == 0.25
        break
    await stream.aclose()
    await eventually(lambda: load() == 0.0, 5, "the stream to close")
    with pytest.raises(ValueError, match="one of them"):
        qwen_fast.load_fnc()
    await tts.aclose()

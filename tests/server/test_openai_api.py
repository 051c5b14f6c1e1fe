"""POST /v1/audio/speech through real OpenAI clients: the openai SDK, LiveKit's openai.TTS and
Pipecat's OpenAITTSService, each pointed at the server with base_url; and the requests it refuses.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import wave

import httpx
import numpy as np
import openai
import pytest

from pipecat_qwen_fast import SynthesisRequest

from .conftest import (
    FRAME_SAMPLES,
    SERVER_MAX_FRAMES,
    VOICE,
    eventually,
    running,
    settings_for,
    settled,
)

pytestmark = pytest.mark.timeout(180)

TEXT = "Hello there, this is the server speaking."
TIMEOUT = 120


def records_after(service, before: int) -> list:
    return service.records_since(before)


async def one_record_after(service, before: int):
    """The record of the one stream opened after stream ``before``, once it has closed."""
    await eventually(lambda: len(service.records_since(before)) == 1, what="the stream's record")
    (record,) = service.records_since(before)
    return record


async def reference_pcm(service, text: str, seed: int,
                        max_frames: int = SERVER_MAX_FRAMES) -> bytes:
    """The same request run in-process on the same engine: what the server must send."""
    request = SynthesisRequest(text, voice=VOICE, seed=seed, max_frames=max_frames)
    pcm = await asyncio.wait_for(service.synthesize(request), TIMEOUT)
    return pcm.astype("<i2").tobytes()


def sdk(server, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=api_key, max_retries=0,
                              timeout=TIMEOUT)


async def test_openai_sdk_streams_the_engines_pcm_as_it_is_made(server, endless_service):
    arrivals: list[tuple[float, int]] = []
    async with sdk(server) as client, client.audio.speech.with_streaming_response.create(
        model="tts-1", voice=VOICE, input=TEXT, response_format="pcm", extra_body={"seed": 7},
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        assert response.headers["transfer-encoding"] == "chunked"
        pieces = []
        async for piece in response.iter_bytes():
            pieces.append(piece)
            arrivals.append((time.monotonic(), len(piece)))
    pcm = b"".join(pieces)
    assert pcm == await reference_pcm(endless_service, TEXT, seed=7)
    # Streamed, not sent whole: the first bytes came before the rest and were a fraction of it.
    assert len(arrivals) > 1 and arrivals[0][1] < len(pcm)
    assert arrivals[0][0] < arrivals[-1][0]


async def test_wav_has_a_streaming_header_and_the_same_audio(server, endless_service):
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        response = await http.post(server.base_url + "/v1/audio/speech", json={
            "model": "tts-1", "input": TEXT, "voice": VOICE, "response_format": "wav", "seed": 3})
    assert response.status_code == 200 and response.headers["content-type"] == "audio/wav"
    with wave.open(io.BytesIO(response.content)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        frames = w.readframes(10**9)
    assert frames == await reference_pcm(endless_service, TEXT, seed=3)


async def test_sse_stream_format_carries_base64_deltas_then_done(server, endless_service):
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        response = await http.post(server.base_url + "/v1/audio/speech", json={
            "model": "gpt-4o-mini-tts", "input": TEXT, "voice": VOICE, "response_format": "pcm",
            "stream_format": "sse", "seed": 5})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ")]
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    deltas = [e for e in events[:-1]]
    assert deltas and all(e["type"] == "speech.audio.delta" for e in deltas)
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert pcm == await reference_pcm(endless_service, TEXT, seed=5)


async def test_livekit_openai_tts_with_base_url(server, endless_service):
    from livekit.plugins import openai as lk_openai

    before = endless_service.streams_opened
    # LiveKit's default model asks for server-sent events; both stream formats must decode.
    for model in ("gpt-4o-mini-tts", "tts-1"):
        tts = lk_openai.TTS(model=model, voice=VOICE, base_url=server.base_url + "/v1",
                            api_key="unused", response_format="pcm")
        try:
            frames = [ev.frame async for ev in tts.synthesize(TEXT)]
        finally:
            await tts.aclose()
        assert {(f.sample_rate, f.num_channels) for f in frames} == {(24000, 1)}
        data = b"".join(bytes(f.data) for f in frames)
        record = await one_record_after(endless_service, before)
        assert record.stop_reason == "frame_cap"  # the whole utterance (EOS never comes here)
        sent = record.frames_decoded * FRAME_SAMPLES * 2
        # All of it, plus at most the 10 ms of silence LiveKit marks a segment's end with.
        assert len(data) in (sent, sent + 480) and data[sent:] == bytes(len(data) - sent)
        before = record.stream_id


def decoded(data: bytes) -> tuple[np.ndarray, int]:
    """A compressed response decoded by PyAV (FFmpeg): int16 mono samples and their rate."""
    import av

    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
        rate = container.streams.audio[0].rate
    samples = np.concatenate(frames)
    if samples.dtype.kind == "f":
        samples = np.round(samples * 32767).astype(np.int16)
    return samples.astype(np.int16), rate


# format, media type, the rate it decodes at, samples the codec may add (its priming and padding)
COMPRESSED = [("flac", "audio/flac", 24000, 0), ("mp3", "audio/mpeg", 24000, 1152 + 2 * 576 + 528),
              ("aac", "audio/aac", 24000, 2 * 1024), ("opus", "audio/ogg", 48000, 960 + 312)]


@pytest.mark.parametrize("fmt, media, rate, padding", COMPRESSED, ids=[c[0] for c in COMPRESSED])
async def test_compressed_formats_stream_through_the_openai_sdk(server, endless_service, fmt, media,
                                                                rate, padding):
    pieces = []
    async with sdk(server) as client, client.audio.speech.with_streaming_response.create(
        model="tts-1", voice=VOICE, input=TEXT, response_format=fmt, extra_body={"seed": 9},
    ) as response:
        assert response.headers["content-type"] == media
        async for piece in response.iter_bytes():
            pieces.append(piece)
    assert len(pieces) > 1  # encoded as the chunks came, not at the end
    samples, decoded_rate = decoded(b"".join(pieces))
    reference = np.frombuffer(await reference_pcm(endless_service, TEXT, seed=9), dtype="<i2")
    assert decoded_rate == rate
    expected = len(reference) * rate // 24000
    assert expected <= len(samples) <= expected + padding, (len(samples), expected)
    if fmt == "flac":  # lossless: the engine's samples exactly
        assert np.array_equal(samples, reference)


async def test_sse_carries_a_compressed_format_whole(server, endless_service):
    # The encoder's tail (its last frames and the container's end) is a delta of its own.
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        response = await http.post(server.base_url + "/v1/audio/speech", json={
            "input": TEXT, "voice": VOICE, "response_format": "flac", "stream_format": "sse",
            "seed": 13})
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done" and len(events) > 2
    data = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    samples, _ = decoded(data)
    reference = np.frombuffer(await reference_pcm(endless_service, TEXT, seed=13), dtype="<i2")
    assert np.array_equal(samples, reference)


async def test_livekit_openai_tts_default_mp3(server, endless_service):
    # LiveKit's openai.TTS asks for mp3 unless told otherwise, and decodes it itself.
    from livekit.plugins import openai as lk_openai

    before = endless_service.streams_opened
    tts = lk_openai.TTS(model="tts-1", voice=VOICE, base_url=server.base_url + "/v1", api_key="unused")
    try:
        frames = [ev.frame async for ev in tts.synthesize(TEXT)]
    finally:
        await tts.aclose()
    record = await one_record_after(endless_service, before)
    heard = sum(f.samples_per_channel for f in frames) * 24000 // frames[0].sample_rate
    assert record.frames_decoded * FRAME_SAMPLES <= heard <= record.frames_decoded * FRAME_SAMPLES + 4800


async def test_pipecat_openai_tts_service_with_base_url(server, endless_service):
    from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.services.openai.tts import OpenAITTSService
    from pipecat.tests.utils import run_test

    before = endless_service.streams_opened
    # Pipecat only sends OpenAI's voice names; the server maps "alloy" to a voice of the model.
    tts = OpenAITTSService(api_key="unused", base_url=server.base_url + "/v1",
                           settings=OpenAITTSService.Settings(voice="alloy"))
    down, up = await asyncio.wait_for(
        run_test(tts, frames_to_send=[TTSSpeakFrame(TEXT)], start_timeout=30), TIMEOUT)
    assert not [f for f in up + down if isinstance(f, ErrorFrame)]
    audio = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
    record = await one_record_after(endless_service, before)
    assert record.stop_reason == "frame_cap"
    assert len(audio) == record.frames_decoded * FRAME_SAMPLES * 2


BAD_REQUESTS = [
    pytest.param(b"{not json", 400, "not valid JSON", id="malformed-json"),
    pytest.param(b"[1, 2]", 400, "must be a JSON object", id="array-body"),
    pytest.param({"voice": VOICE}, 400, "'input' is required", id="missing-input"),
    pytest.param({"input": 5, "voice": VOICE}, 400, "'input' must be a string", id="input-number"),
    pytest.param({"input": TEXT, "voice": ["ryan"]}, 400, "'voice' must be a string",
                 id="voice-array"),
    pytest.param({"input": TEXT, "voice": VOICE, "seed": True}, 400, "'seed' must be an integer",
                 id="seed-bool"),
    pytest.param({"input": TEXT, "voice": VOICE, "speed": "fast"}, 400, "'speed' must be a number",
                 id="speed-string"),
    pytest.param({"input": TEXT, "voice": VOICE, "speed": 1.5}, 400, "'speed' must be 1.0",
                 id="speed-1.5"),
    pytest.param({"input": TEXT, "voice": "nobody"}, 400, "valid voices: ", id="unknown-voice"),
    pytest.param({"input": TEXT, "voice": VOICE, "response_format": "m4a"}, 400,
                 "valid choices: pcm, wav, mp3, opus, aac, flac", id="unknown-format"),
    pytest.param({"input": TEXT, "voice": VOICE, "stream_format": "json"}, 400,
                 "valid choices: audio, sse", id="unknown-stream-format"),
    pytest.param({"input": TEXT, "voice": VOICE, "language": "klingon"}, 400, "valid languages",
                 id="unknown-language"),
    pytest.param({"input": TEXT, "voice": VOICE, "volume": 3}, 400, "unknown field(s)",
                 id="unknown-field"),
    pytest.param({"input": "   ", "voice": VOICE}, 400, "nothing to say", id="blank-input"),
    pytest.param({"input": "words " * 1000, "voice": VOICE}, 400, "the limit is 4096",
                 id="input-over-limit"),
    pytest.param({"input": "x" * 1_000_000, "voice": VOICE}, 413, "limit is", id="1MB-input"),
]


@pytest.mark.parametrize("body, status, message", BAD_REQUESTS)
async def test_bad_requests_get_a_clear_4xx_and_the_server_keeps_serving(server, body, status,
                                                                         message):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        response = await http.post(server.base_url + "/v1/audio/speech", content=data,
                                   headers={"content-type": "application/json"})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert message in error["message"]
        # Never the text back: a message is short and names fields, not their contents.
        assert "words words" not in response.text and "xxxxxxxx" not in response.text
        good = await http.post(server.base_url + "/v1/audio/speech", json={
            "input": "Still here.", "voice": VOICE, "response_format": "pcm"})
    assert good.status_code == 200 and len(good.content) > 0
    assert len(good.content) % (2 * FRAME_SAMPLES) == 0


async def test_openai_sdk_raises_its_bad_request_error_with_the_servers_message(server):
    async with sdk(server) as client:
        with pytest.raises(openai.BadRequestError, match="valid voices: "):
            await client.audio.speech.create(model="tts-1", voice="nobody", input=TEXT)


async def test_api_key_is_required_when_set(endless_service, endless_path):
    settings = settings_for(endless_path, api_key="sekret")
    with running(settings, endless_service) as srv:
        url = srv.base_url + "/v1/audio/speech"
        body = {"input": "Who goes there?", "voice": VOICE, "response_format": "pcm",
                "max_new_tokens": 12}
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            missing = await http.post(url, json=body)
            wrong = await http.post(url, json=body, headers={"Authorization": "Bearer nope"})
            bearer = await http.post(url, json=body, headers={"Authorization": "Bearer sekret"})
            api_key = await http.post(url, json=body,
                                      headers={"Authorization": "Api-Key sekret"})
            probes = [await http.get(srv.base_url + p) for p in ("/health", "/ready", "/metrics")]
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["code"] == "missing_api_key"
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert bearer.status_code == 200 and len(bearer.content) > 0
        assert api_key.status_code == 200 and len(api_key.content) > 0
        assert [p.status_code for p in probes] == [200, 200, 200]
        async with sdk(srv, api_key="nope") as client:
            with pytest.raises(openai.AuthenticationError):
                await client.audio.speech.create(model="tts-1", voice=VOICE, input="Hello?",
                                                 extra_body={"max_new_tokens": 12})
        async with sdk(srv, api_key="sekret") as client:
            models = await client.models.list()
            assert [m.id for m in models.data] == [srv.ctx.settings.model_name]


async def test_full_server_refuses_with_503_and_retry_after_then_recovers(endless_service,
                                                                        endless_path):
    settings = settings_for(endless_path, max_streams=1, retry_after_s=2)
    with running(settings, endless_service) as srv:
        url = srv.base_url + "/v1/audio/speech"
        body = {"input": TEXT, "voice": VOICE, "response_format": "pcm"}
        async with httpx.AsyncClient(timeout=TIMEOUT) as http:
            async with http.stream("POST", url, json=body) as holding:
                assert holding.status_code == 200
                # In flight, holding the only slot. (The iterator is kept: dropping it would
                # close the response.)
                pieces = holding.aiter_raw()
                await anext(pieces)
                refused = await http.post(url, json=body)
                assert refused.status_code == 503
                assert refused.headers["retry-after"] == "2"
                assert refused.json()["error"]["code"] == "overloaded"
                async with sdk(srv) as client:
                    with pytest.raises(openai.InternalServerError):
                        await client.audio.speech.create(model="tts-1", voice=VOICE, input=TEXT)
            await eventually(lambda: settled(srv), what="the slot to free")
            again = await http.post(url, json={**body, "max_new_tokens": 12})
            metrics = (await http.get(srv.base_url + "/metrics")).text
        assert again.status_code == 200 and len(again.content) > 0
        assert 'qwen_tts_refusals_total{reason="overloaded"} 2.0' in metrics


async def test_client_that_hangs_up_mid_stream_frees_its_engine_session(server, endless_service):
    long_text = " ".join(["This sentence keeps the engine busy for a while."] * 8)
    before = endless_service.streams_opened
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        async with http.stream("POST", server.base_url + "/v1/audio/speech", json={
                "input": long_text, "voice": VOICE, "response_format": "pcm"}) as response:
            assert response.status_code == 200
            pieces = response.aiter_raw()
            await anext(pieces)
        # Leaving the block closes the connection with most of the utterance unsent.
    await eventually(lambda: settled(server) and records_after(endless_service, before),
               what="the stream to be freed")
    (record,) = records_after(endless_service, before)
    assert record.stop_reason == "cancelled"
    assert record.frames_at_cancel is not None
    assert record.frames_decoded - record.frames_at_cancel <= 1


async def test_voices_and_models_are_listed(server):
    async with httpx.AsyncClient(timeout=TIMEOUT) as http, sdk(server) as client:
        voices = (await http.get(server.base_url + "/v1/audio/voices")).json()
        models = await client.models.list()
    assert VOICE in voices["voices"] and voices["aliases"] == {"alloy": VOICE}
    assert "english" in voices["languages"] and voices["model_type"] == "custom_voice"
    assert [m.id for m in models.data] == [server.ctx.settings.model_name]


"""Voices cloned inline over the WebSocket (session.config's ref_audio, as vLLM-Omni and LiveKit's
Qwen3TTS client send it) on a Base model: the same audio as the uploaded voice of the same
recording, made once per recording, and the references the server refuses, each with a clear
error event on a socket that stays open."""

from __future__ import annotations

import base64
import json

import aiohttp
import httpx
import pytest

from .conftest import FRAME_SAMPLES, eventually, settled
from .test_voices import upload, wav_bytes
from .test_ws import read_until_done

pytestmark = pytest.mark.timeout(240)

TIMEOUT = 60
FRAMES = 6
TEXT = "Say it."


def config(**fields) -> dict:
    return {"type": "session.config", "task_type": "Base", "seed": 7, "max_new_tokens": FRAMES,
            "non_streaming_mode": True, **fields}


async def speak(ws: aiohttp.ClientWebSocketResponse, cfg: dict) -> bytes:
    await ws.send_json(cfg)
    await ws.send_json({"type": "input.text", "text": TEXT})
    await ws.send_json({"type": "input.done"})
    items = await read_until_done(ws)
    assert not [i for i in items if isinstance(i, dict) and i["type"] == "error"], items
    return b"".join(i for i in items if isinstance(i, bytes))


async def test_inline_clone_sounds_as_the_upload_and_is_made_once(base_server):
    srv = base_server
    recording = wav_bytes(2.0, seed=3)
    b64 = base64.b64encode(recording).decode()
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as http:
        assert (await upload(http, "carol", recording, ref_text="Hello there.")).status_code == 201
        assert (await upload(http, "carol-x", recording)).status_code == 201
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(srv.ws_url) as ws:
                named = await speak(ws, config(voice="carol"))
                named_x = await speak(ws, config(voice="carol-x"))
                inline = await speak(ws, config(voice="ignored", ref_audio=b64,
                                                ref_text="Hello there."))
                # The transcript is not used in x-vector-only mode, as in the official model.
                inline_x = await speak(ws, config(ref_audio=f"data:audio/wav;base64,{b64}",
                                                  ref_text="Hello there.", x_vector_only_mode=True))
            async with session.ws_connect(srv.ws_url) as ws:  # another socket, the same reference
                again = await speak(ws, config(ref_audio=b64, ref_text="Hello there."))
        listed = (await http.get("/v1/audio/voices")).json()
        for name in ("carol", "carol-x"):
            assert (await http.delete(f"/v1/audio/voices/{name}")).status_code == 204
    assert len(named) == FRAMES * FRAME_SAMPLES * 2 and named != named_x
    assert inline == named == again and inline_x == named_x
    assert len(srv.ctx.inline_voices) == 2  # one ICL, one x-vector: the third was kept
    assert listed["cloned"] == ["carol", "carol-x"]  # inline voices are not registered by name
    await eventually(lambda: settled(srv), what="the streams to close")


BAD_REFERENCES = [
    pytest.param({"ref_audio": "not base64 at all!"}, "not valid base64", id="not-base64"),
    pytest.param({"ref_audio": base64.b64encode(b"RIFF junk" * 20).decode()}, "reference audio",
                 id="not-audio"),
    pytest.param({"ref_audio": base64.b64encode(wav_bytes(0.4)).decode()}, "s long", id="short"),
    pytest.param({"ref_audio": "https://example.invalid/a.wav"}, "not fetched", id="url"),
    pytest.param({"ref_audio": "data:audio/wav,abc"}, "must be base64", id="data-url"),
    pytest.param({"ref_audio": ""}, "ref_audio is empty", id="empty"),
    pytest.param({"ref_audio": 3}, "'ref_audio' must be a string", id="wrong-type"),
    pytest.param({"ref_text": "Hello."}, "ref_text needs ref_audio", id="text-alone"),
    pytest.param({"speaker_embedding": [0.1, 0.2]}, "speaker_embedding is not supported",
                 id="embedding"),
]


@pytest.mark.parametrize("change, message", BAD_REFERENCES)
async def test_a_bad_reference_is_an_error_event_and_the_socket_stays_open(base_server, change,
                                                                          message):
    good = base64.b64encode(wav_bytes(2.0, seed=4)).decode()
    async with aiohttp.ClientSession() as http, http.ws_connect(base_server.ws_url) as ws:
        await ws.send_json(config(**change))
        error = json.loads((await ws.receive(timeout=TIMEOUT)).data)
        assert error["type"] == "error" and message in error["message"], error
        assert len(await speak(ws, config(ref_audio=good))) == FRAMES * FRAME_SAMPLES * 2


async def test_a_long_message_is_refused_unless_it_is_a_session_config(base_server):
    big = base64.b64encode(wav_bytes(20.0, seed=5)).decode()  # ~1.3 MB, far over the text bound
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(base_server.ws_url) as ws:
            assert len(await speak(ws, config(ref_audio=big))) == FRAMES * FRAME_SAMPLES * 2
        async with http.ws_connect(base_server.ws_url) as ws:
            await ws.send_json(config(ref_audio=big))
            await ws.send_json({"type": "input.text", "text": "x" * len(big)})
            items = await read_until_done(ws)
        error = [i for i in items if isinstance(i, dict) and i["type"] == "error"]
        assert error and "over the limit" in error[0]["message"] and ws.close_code == 1009


async def test_livekit_qwen3tts_client_clones_inline(base_server, tmp_path):
    from livekit.plugins import baseten

    ref = tmp_path / "ref.wav"
    ref.write_bytes(wav_bytes(2.0, seed=6))
    kept = len(base_server.ctx.inline_voices)
    async with aiohttp.ClientSession() as http:
        tts = baseten.TTS(model="qwen3-tts", model_endpoint=base_server.ws_url, api_key="unused",
                          voice="my-clone", task_type="Base", ref_audio=str(ref),
                          ref_text="Hello there.", max_new_tokens=FRAMES, http_session=http)
        try:
            stream = tts.stream()
            stream.push_text("Hello from a cloned voice.")
            stream.end_input()
            frames = [ev.frame async for ev in stream]
            await stream.aclose()
        finally:
            await tts.aclose()
    assert sum(f.samples_per_channel for f in frames) >= FRAMES * FRAME_SAMPLES
    assert len(base_server.ctx.inline_voices) == kept + 1  # its recording became a voice
    await eventually(lambda: settled(base_server), what="the streams to close")

"""Voices cloned inline over POST /v1/audio/speech (vLLM-Omni's ref_audio, ref_text and
x_vector_only_mode in the body) on a Base model, through the OpenAI SDK: the same audio as the
uploaded voice of the same recording, each recording encoded once for the socket and HTTP alike,
and every reference the server refuses answered with a 4xx naming the problem."""

from __future__ import annotations

import asyncio
import base64
import threading

import httpx
import openai
import pytest

from pipecat_qwen_fast.server.inline_voices import MAX_INLINE_BYTES, MAX_MAKING

from .conftest import FRAME_SAMPLES, eventually, settled
from .test_voices import upload, wav_bytes
from .test_ws_clone import BAD_REFERENCES

pytestmark = pytest.mark.timeout(240)

TIMEOUT = 60
FRAMES = 6
TEXT = "Say it over HTTP."


def sdk(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                              timeout=TIMEOUT)


async def speak(client: openai.AsyncOpenAI, voice: str = "unused", **extra) -> bytes:
    response = await client.audio.speech.create(
        model="tts-1", voice=voice, input=TEXT, response_format="pcm",
        extra_body={"seed": 11, "max_new_tokens": FRAMES, **extra})
    return response.content


async def test_openai_sdk_clones_inline_as_the_upload_sounds(base_server):
    srv = base_server
    recording = wav_bytes(2.0, seed=21)
    b64 = base64.b64encode(recording).decode()
    kept = len(srv.ctx.inline_voices)
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as http, sdk(srv) as client:
        assert (await upload(http, "dora", recording, ref_text="Hello there.")).status_code == 201
        assert (await upload(http, "dora-x", recording)).status_code == 201
        try:
            named = await speak(client, "dora")
            named_x = await speak(client, "dora-x")
            inline = await speak(client, task_type="Base", ref_audio=b64, ref_text="Hello there.")
            again = await speak(client, ref_audio=f"data:audio/wav;base64,{b64}", ref_text="Hello there.")
            inline_x = await speak(client, ref_audio=b64, ref_text="Hello there.", x_vector_only_mode=True)
        finally:
            for name in ("dora", "dora-x"):
                assert (await http.delete(f"/v1/audio/voices/{name}")).status_code == 204
    assert len(named) == FRAMES * FRAME_SAMPLES * 2 and named != named_x
    assert inline == named == again and inline_x == named_x
    assert len(srv.ctx.inline_voices) == kept + 2  # one ICL, one x-vector: the data: URL was kept
    await eventually(lambda: settled(srv), what="the streams to close")


@pytest.mark.parametrize("change, message", BAD_REFERENCES)
async def test_a_bad_reference_is_a_400_naming_it(base_server, change, message):
    async with httpx.AsyncClient(base_url=base_server.base_url, timeout=TIMEOUT) as http:
        response = await http.post("/v1/audio/speech", json={
            "input": TEXT, "voice": "unused", "max_new_tokens": FRAMES, **change})
    error = response.json()["error"]
    assert response.status_code == 400 and message in error["message"], error
    assert error["param"] in change or error["param"] == "ref_audio"
    await eventually(lambda: settled(base_server), what="nothing left open")


async def test_a_recording_fits_a_base_servers_body_bound_and_nothing_else_does(base_server, server):
    big = base64.b64encode(wav_bytes(20.0, seed=22)).decode()  # ~1.3 MB, far over the text bound
    async with sdk(base_server) as client:
        assert len(await speak(client, ref_audio=big)) == FRAMES * FRAME_SAMPLES * 2
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        too_big = await http.post(base_server.base_url + "/v1/audio/speech", json={
            "input": TEXT, "voice": "unused", "ref_audio": "A" * (MAX_INLINE_BYTES + 100_000)})
        on_custom_voice = await http.post(server.base_url + "/v1/audio/speech", json={
            "input": TEXT, "voice": "unused", "ref_audio": big})
    assert too_big.status_code == 413 and "ref_audio by" in too_big.json()["error"]["message"]
    assert on_custom_voice.status_code == 413  # no recording is taken there: the text's bound


async def test_a_custom_voice_server_names_what_it_cannot_do(server):
    small = base64.b64encode(wav_bytes(0.1, seed=23)).decode()  # within the text bound
    async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT) as http:
        clone = await http.post("/v1/audio/speech", json={
            "input": TEXT, "voice": "unused", "ref_audio": small})
        task = await http.post("/v1/audio/speech", json={
            "input": TEXT, "voice": "unused", "task_type": "Base"})
    assert clone.status_code == 400 and "needs a Base model" in clone.json()["error"]["message"]
    assert task.status_code == 400
    assert "does not match this server's model, a CustomVoice model" in task.json()["error"]["message"]


async def test_recordings_past_the_encoders_queue_are_refused_not_held(base_server, monkeypatch):
    # The encoders held up: MAX_MAKING new recordings wait, one more is refused at once with a
    # retry hint (its 4 MB body is not held behind them); those waiting are then all served.
    engine = base_server.ctx.require_ready().engine
    gate = threading.Event()
    create_voice = engine.create_voice

    def held_create_voice(*args, **kw):
        gate.wait(TIMEOUT)
        return create_voice(*args, **kw)

    monkeypatch.setattr(engine, "create_voice", held_create_voice)
    recordings = [base64.b64encode(wav_bytes(1.5, seed=100 + i)).decode() for i in range(MAX_MAKING + 1)]
    making = base_server.ctx.inline_voices._making
    async with httpx.AsyncClient(base_url=base_server.base_url, timeout=TIMEOUT) as http:
        def post(recording: str):
            return http.post("/v1/audio/speech", json={
                "input": TEXT, "voice": "unused", "max_new_tokens": FRAMES, "ref_audio": recording})

        waiting = [asyncio.create_task(post(r)) for r in recordings[:MAX_MAKING]]
        try:
            await eventually(lambda: len(making) == MAX_MAKING, what="the queue to fill")
            refused = await post(recordings[MAX_MAKING])
        finally:
            gate.set()
        served = await asyncio.gather(*waiting)
    error = refused.json()["error"]
    assert refused.status_code == 503 and refused.headers["Retry-After"], error
    assert error["code"] == "overloaded" and "already waiting to be cloned" in error["message"]
    assert [r.status_code for r in served] == [200] * MAX_MAKING
    await eventually(lambda: settled(base_server), what="the streams to close")

"""Voices over HTTP on a Base model: upload a recording, list it, speak with it over HTTP and the
WebSocket, delete it; and the uploads the server refuses, each with a clear 4xx."""

from __future__ import annotations

import asyncio
import io
import wave

import aiohttp
import httpx
import numpy as np
import pytest

from pipecat_qwen_fast import SynthesisRequest
from pipecat_qwen_fast.server.voices_api import MAX_UPLOAD_BYTES

from .conftest import FRAME_SAMPLES, eventually, settled
from .test_ws import read_until_done

pytestmark = pytest.mark.timeout(240)

TIMEOUT = 60
FRAMES = 6


def wav_bytes(seconds: float, rate: int = 24000, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    samples = 0.3 * np.sin(2 * np.pi * 180 * t) + 0.05 * rng.standard_normal(t.size)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return out.getvalue()


async def upload(http: httpx.AsyncClient, name: str | None, audio: bytes | None,
                 ref_text: str | None = None) -> httpx.Response:
    data = {k: v for k, v in {"name": name, "ref_text": ref_text}.items() if v is not None}
    files = {"file": ("ref.wav", audio, "audio/wav")} if audio is not None else None
    if files is None:
        # httpx sends a form without files url-encoded; a field sent as a part keeps it multipart.
        files = {"name": (None, name or "")}
        data = {}
    return await http.post("/v1/audio/voices", data=data, files=files)


async def test_uploaded_voice_is_listed_spoken_over_http_and_ws_then_deleted(base_server):
    srv = base_server
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as http:
        before = (await http.get("/v1/audio/voices")).json()
        assert before["model_type"] == "base" and before["cloned"] == []
        made = await upload(http, "Alice-1", wav_bytes(2.0), ref_text="Hello there.")
        assert made.status_code == 201, made.text
        assert made.json() == {"name": "Alice-1", "ref_seconds": 2.0, "mode": "icl"}
        xvec = await upload(http, "bob", wav_bytes(1.5, rate=16000, seed=1))
        assert xvec.status_code == 201 and xvec.json()["mode"] == "x_vector"
        listed = (await http.get("/v1/audio/voices")).json()
        assert listed["cloned"] == ["Alice-1", "bob"] and listed["voices"] == ["Alice-1", "bob"]

        body = {"input": "Say it.", "voice": "Alice-1", "response_format": "pcm", "seed": 7,
                "max_new_tokens": FRAMES}
        speech = await http.post("/v1/audio/speech", json=body)
        assert speech.status_code == 200, speech.text
        reference = await asyncio.wait_for(srv.ctx.service.synthesize(SynthesisRequest(
            "Say it.", voice="Alice-1", seed=7, max_frames=FRAMES)), TIMEOUT)
        assert speech.content == reference.astype("<i2").tobytes()
        assert len(speech.content) == FRAMES * FRAME_SAMPLES * 2

        async with aiohttp.ClientSession() as session, session.ws_connect(srv.ws_url) as ws:
            await ws.send_json({"type": "session.config", "voice": "bob", "task_type": "Base",
                                "max_new_tokens": FRAMES})
            await ws.send_json({"type": "input.text", "text": "Say it."})
            await ws.send_json({"type": "input.done"})
            items = await read_until_done(ws)
        assert not [i for i in items if isinstance(i, dict) and i["type"] == "error"], items
        assert sum(len(i) for i in items if isinstance(i, bytes)) > 0

        assert (await http.delete("/v1/audio/voices/Alice-1")).status_code == 204
        gone = await http.delete("/v1/audio/voices/Alice-1")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "voice_not_found"
        refused = await http.post("/v1/audio/speech", json=body)
        assert refused.status_code == 400 and "unknown voice 'Alice-1'" in \
            refused.json()["error"]["message"]
        # A path is never read as a voice file from the network.
        path = await http.post("/v1/audio/speech", json={**body, "voice": "/etc/passwd.voice"})
        assert path.status_code == 400
        assert (await http.get("/v1/audio/voices")).json()["cloned"] == ["bob"]
        await eventually(lambda: settled(srv), what="the streams to close")


@pytest.mark.parametrize(("name", "audio", "status", "says"), [
    ("short", wav_bytes(0.4), 400, "s long"),
    ("long", wav_bytes(31.0), 400, "s long"),
    ("garbage", b"RIFF not really a wav file" * 10, 400, "reference audio"),
    ("bad name!", wav_bytes(2.0), 400, "voice name"),
    ("x.voice", wav_bytes(2.0), 400, "voice name"),
    ("nofile", None, 400, "'file' is required"),
    ("big", b"\0" * (MAX_UPLOAD_BYTES + 1), 413, "the limit is"),
])
async def test_bad_uploads_get_a_clear_4xx_and_register_nothing(base_server, name, audio, status,
                                                                says):
    async with httpx.AsyncClient(base_url=base_server.base_url, timeout=TIMEOUT) as http:
        response = await upload(http, name, audio)
        assert response.status_code == status, response.text
        assert says in response.json()["error"]["message"]
        assert name not in (await http.get("/v1/audio/voices")).json()["cloned"]


async def test_duplicate_name_is_409_and_keeps_the_first_voice(base_server):
    async with httpx.AsyncClient(base_url=base_server.base_url, timeout=TIMEOUT) as http:
        assert (await upload(http, "dup", wav_bytes(2.0))).status_code == 201
        first = base_server.ctx.service.engine.voice_library.get("dup").fingerprint
        again = await upload(http, "dup", wav_bytes(2.5, seed=3))
        assert again.status_code == 409 and again.json()["error"]["code"] == "voice_exists"
        assert base_server.ctx.service.engine.voice_library.get("dup").fingerprint == first
        not_form = await http.post("/v1/audio/voices", json={"name": "x"})
        assert not_form.status_code == 400 and "multipart" in not_form.json()["error"]["message"]
        assert (await http.delete("/v1/audio/voices/dup")).status_code == 204


async def test_upload_to_a_model_that_is_not_base_is_a_400(server):
    async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT) as http:
        response = await upload(http, "alice", wav_bytes(2.0))
        deleted = await http.delete("/v1/audio/voices/alice")
    assert response.status_code == 400
    assert "only to a Base model" in response.json()["error"]["message"]
    assert deleted.status_code == 400

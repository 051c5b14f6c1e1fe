"""The server with its engine in a child process (`serve --engine-process`): the same API, the
same audio as in-process, barge-ins that free the engine's session, voices made in the child,
and a child that dies answered with clean errors and a failed /health."""

from __future__ import annotations

import asyncio
import base64
import gc
import os
import signal

import aiohttp
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipecat_qwen_fast.engine import heap

from .conftest import SERVER_MAX_FRAMES, VOICE, eventually, running, settings_for, settled
from .test_voices import upload, wav_bytes
from .test_ws import (
    CONFIG,
    LONG_TEXT,
    MAX_MESSAGES,
    TIMEOUT,
    events,
    read_until_done,
    reference_pcm,
    send_turn,
    sentence_pcm,
)
from .test_ws_streamed import speak_pieces

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def proc_server(endless_path):
    settings = settings_for(endless_path, voice_aliases={"alloy": VOICE},
                            max_frames=SERVER_MAX_FRAMES, engine_process=True)
    with running(settings) as srv:
        yield srv


async def ready(srv) -> None:
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as http:
        for _ in range(1800):
            if (await http.get("/ready")).status_code == 200:
                return
            await asyncio.sleep(0.1)
    raise TimeoutError("the engine process did not get ready")


async def start_long_turn(ws) -> None:
    """A turn of 400 frames on `ws`, returned once its first audio is in."""
    await ws.send_json({**CONFIG, "max_new_tokens": 400})
    await ws.send_json({"type": "input.text", "text": LONG_TEXT})
    await ws.send_json({"type": "input.done"})
    for _ in range(MAX_MESSAGES):
        msg = await ws.receive(timeout=TIMEOUT)
        if msg.type is aiohttp.WSMsgType.BINARY:
            return
    raise AssertionError("no audio")


async def test_engine_runs_in_a_child_process_and_speaks_as_in_process(proc_server, endless_service):
    await ready(proc_server)
    service = proc_server.ctx.service
    assert service.pid not in (None, os.getpid())
    # The server's own heap is frozen too, once the engine is ready (no long full collections),
    # and held so by the engine process (another test's freeze would also make the count > 0).
    assert gc.get_freeze_count() > 0
    assert id(service) in heap._holders
    async with aiohttp.ClientSession() as http, http.ws_connect(proc_server.ws_url) as ws:
        await ws.send_json({**CONFIG, "seed": 3})
        await send_turn(ws, "One sentence here. Ano", "ther one follows.")
        items = await read_until_done(ws)
    first, second = sentence_pcm(items)
    assert items[-1] == {"type": "session.done", "total_sentences": 2}
    assert first == await reference_pcm(endless_service, "One sentence here.", 3, 12)
    assert second == await reference_pcm(endless_service, "Another one follows.", 3, 12)
    async with httpx.AsyncClient(base_url=proc_server.base_url, timeout=TIMEOUT) as http:
        speech = await http.post("/v1/audio/speech", json={
            "input": "One sentence here.", "voice": "alloy", "response_format": "pcm", "seed": 3,
            "max_new_tokens": 12})
        assert speech.status_code == 200
        assert speech.content == await reference_pcm(endless_service, "One sentence here.", 3, 12)
        unknown = await http.post("/v1/audio/speech", json={"input": "Hi.", "voice": "nobody"})
        assert unknown.status_code == 400 and "valid voices" in unknown.json()["error"]["message"]
        # The engine process's rounds reach /metrics (bench fleet reads them per level).
        await asyncio.sleep(0.5)
        metrics_text = (await http.get("/metrics")).text
        samples = {s.name: s.value for f in text_string_to_metric_families(metrics_text) for s in f.samples}
    assert samples["qwen_tts_engine_rounds_total"] > 0
    assert samples["qwen_tts_engine_round_seconds_total"] > 0
    assert samples["qwen_tts_engine_round_streams_total"] >= samples["qwen_tts_engine_rounds_total"]
    # The engine process's threads' CPU time: the engine's ran the rounds, the relay the streams.
    cpu = {s.labels["thread"]: s.value for f in text_string_to_metric_families(metrics_text)
           for s in f.samples if s.name == "qwen_tts_engine_thread_cpu_seconds_total"}
    assert set(cpu) == {"engine", "relay", "pipe"} and cpu["engine"] > 0 and cpu["relay"] > 0
    # Admission by slack is off on a CPU ("auto"): slack is watched, nothing counts as low.
    assert samples["qwen_tts_engine_low_slack_chunks_total"] == 0
    assert "qwen_tts_engine_lowest_slack_ms" in samples


async def test_streamed_text_turn_and_its_word_times_equal_in_process(proc_server, server):
    await ready(proc_server)
    for transport in ("sync", "async"):
        there = await speak_pieces(proc_server.ws_url, transport)
        here = await speak_pieces(server.ws_url, transport)
        assert there[-1] == {"type": "session.done", "total_sentences": 1}
        assert there == here  # events, word times and audio


async def test_socket_that_leaves_mid_stream_frees_the_child_session(proc_server):
    await ready(proc_server)
    service = proc_server.ctx.service
    async with aiohttp.ClientSession() as http, http.ws_connect(proc_server.ws_url) as ws:
        await start_long_turn(ws)
        # The child counts the turn while it runs (its report comes every 0.2 s).
        await eventually(lambda: service.admitted_streams == 1, what="the child's count")
    await eventually(lambda: settled(proc_server) and not service._streams,
                     what="the stream to be closed in the child")
    # The child's own count (reported every 0.2 s) comes back to zero: its session was freed.
    await eventually(lambda: service.admitted_streams == 0, what="the child's session to be freed")


async def test_voices_are_made_and_removed_in_the_child(base_path, base_server):
    recording = wav_bytes(2.0, seed=21)
    b64 = base64.b64encode(recording).decode()
    settings = settings_for(base_path, engine_process=True)
    with running(settings) as srv:
        await ready(srv)
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as http:
            made = await upload(http, "dora", recording, ref_text="Hello there.")
            assert made.status_code == 201, made.text
            assert made.json() == {"name": "dora", "ref_seconds": 2.0, "mode": "icl"}
            assert (await http.get("/v1/audio/voices")).json()["cloned"] == ["dora"]
            # The child's library answers at once: no second voice of the same name.
            assert (await upload(http, "dora", recording)).status_code == 409
            body = {"input": "Say it over HTTP.", "response_format": "pcm", "seed": 11,
                    "max_new_tokens": 6}
            named = await http.post("/v1/audio/speech", json={**body, "voice": "dora"})
            inline = await http.post("/v1/audio/speech", json={
                **body, "ref_audio": b64, "ref_text": "Hello there.", "task_type": "Base"})
            assert named.status_code == inline.status_code == 200
            assert named.content == inline.content and len(named.content) > 0
            assert (await http.delete("/v1/audio/voices/dora")).status_code == 204
            assert (await http.get("/v1/audio/voices")).json()["cloned"] == []
        # The same voice in process (the module's Base server) sounds the same.
        async with httpx.AsyncClient(base_url=base_server.base_url, timeout=TIMEOUT) as http:
            here = await http.post("/v1/audio/speech", json={
                **body, "ref_audio": b64, "ref_text": "Hello there.", "task_type": "Base"})
        assert here.content == named.content


async def test_a_dead_engine_process_ends_streams_cleanly_and_fails_health(endless_path):
    settings = settings_for(endless_path, max_frames=400, engine_process=True)
    with running(settings) as srv:
        await ready(srv)
        service = srv.ctx.service
        async with aiohttp.ClientSession() as http, http.ws_connect(srv.ws_url) as ws:
            await start_long_turn(ws)
            os.kill(service.pid, signal.SIGKILL)
            items = await read_until_done(ws)
        errors = [e for e in events(items) if e["type"] == "error"]
        assert errors, items[-3:]
        await eventually(lambda: settled(srv), what="the server to free the stream")
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as http:
            health = await http.get("/health")
            assert (health.status_code, health.json()) == (503, {"status": "failed"})
            speech = await http.post("/v1/audio/speech", json={"input": "Hi.", "voice": VOICE})
            assert speech.status_code == 503
            assert speech.json()["error"]["code"] == "engine_unavailable"

"""WebSocket /v1/audio/speech/stream: LiveKit's Qwen3TTS client (livekit-plugins-baseten) unchanged,
a raw aiohttp client speaking the same protocol message by message, and the sockets that break it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import httpx
import pytest

from pipecat_qwen_fast import SynthesisRequest
from pipecat_qwen_fast.bench.fleet import count_delta
from pipecat_qwen_fast.bench.fleet_workload import labelled, parse_metrics

from .conftest import (
    FRAME_SAMPLES,
    VOICE,
    eventually,
    running,
    settings_for,
    settled,
)

pytestmark = pytest.mark.timeout(180)

TIMEOUT = 60
CONFIG = {"type": "session.config", "voice": VOICE, "task_type": "CustomVoice",
          "language": "Auto", "response_format": "pcm", "stream_audio": True, "speed": 1.0,
          "max_new_tokens": 12}
LONG_TEXT = " ".join(["This sentence keeps the engine busy for a while."] * 6)
MAX_MESSAGES = 5000


async def read_until_done(ws: aiohttp.ClientWebSocketResponse, within: float = TIMEOUT) -> list:
    """Events (dicts) and audio (bytes) up to and including session.done, or ("closed", code)."""
    items: list = []
    deadline = time.monotonic() + within
    for _ in range(MAX_MESSAGES):
        msg = await ws.receive(timeout=max(0.01, deadline - time.monotonic()))
        if msg.type is aiohttp.WSMsgType.BINARY:
            items.append(msg.data)
        elif msg.type is aiohttp.WSMsgType.TEXT:
            event = json.loads(msg.data)
            items.append(event)
            if event["type"] == "session.done":
                return items
        else:
            items.append(("closed", ws.close_code))
            return items
    raise AssertionError("too many messages")


def events(items: list) -> list[dict]:
    return [i for i in items if isinstance(i, dict)]


async def send_turn(ws, *pieces: str) -> None:
    for piece in pieces:
        await ws.send_json({"type": "input.text", "text": piece})
    await ws.send_json({"type": "input.done"})


def sentence_pcm(items: list) -> list[bytes]:
    """Each sentence's audio: the bytes between its audio.start and its audio.done."""
    out: list[bytes] = []
    for item in items:
        if isinstance(item, dict) and item["type"] == "audio.start":
            out.append(b"")
        elif isinstance(item, bytes):
            out[-1] += item
    return out


async def reference_pcm(service, text: str, seed: int, max_frames: int) -> bytes:
    request = SynthesisRequest(text, voice=VOICE, seed=seed, max_frames=max_frames)
    pcm = await asyncio.wait_for(service.synthesize(request), TIMEOUT)
    return pcm.astype("<i2").tobytes()


async def still_serves(url: str, headers: dict | None = None) -> None:
    """A fresh socket gets a session.done for an empty flush: the server is still answering."""
    async with aiohttp.ClientSession() as http, http.ws_connect(url, headers=headers) as ws:
        await ws.send_json(CONFIG)
        await ws.send_json({"type": "input.done"})
        assert events(await read_until_done(ws)) == [{"type": "session.done", "total_sentences": 0}]


async def test_livekit_qwen3tts_client_speaks_two_turns_on_one_warm_socket(server,
                                                                          endless_service):
    from livekit.plugins import baseten

    before = endless_service.streams_opened
    async with aiohttp.ClientSession() as http:
        tts = baseten.TTS(model="qwen3-tts", model_endpoint=server.ws_url, api_key="unused",
                          voice=VOICE, task_type="CustomVoice", max_new_tokens=12,
                          http_session=http)
        samples = []
        try:
            for pieces in (["Hello there. ", "How are", " you today?"], ["Second turn."]):
                stream = tts.stream()
                for piece in pieces:
                    stream.push_text(piece)
                stream.end_input()
                frames = [ev.frame async for ev in stream]
                await stream.aclose()
                assert {(f.sample_rate, f.num_channels) for f in frames} == {(24000, 1)}
                samples.append(sum(f.samples_per_channel for f in frames))
            # The client parks its socket between turns: one connection served both.
            assert server.ctx.open_sockets == 1
        finally:
            await tts.aclose()
    await eventually(lambda: len(endless_service.records_since(before)) == 3, what="three streams")
    records = endless_service.records_since(before)
    frames = [r.frames_decoded for r in records]
    assert [r.stop_reason for r in records] == ["frame_cap"] * 3 and frames == [12, 12, 12]
    # Turn 1 was two sentences ("Hello there." and "How are you today?"), turn 2 one. LiveKit may
    # end a segment with 10 ms of silence.
    for got, sent in zip(samples, (2 * 12 * FRAME_SAMPLES, 12 * FRAME_SAMPLES), strict=True):
        assert got in (sent, sent + 240)
    await eventually(lambda: server.ctx.open_sockets == 0, what="the socket to close")


async def test_protocol_messages_in_order_and_audio_equal_to_in_process(server, endless_service):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws_url) as ws:
        await ws.send_json({**CONFIG, "seed": 3})
        # An empty flush (the client's keepalive) answers at once with no sentences.
        await ws.send_json({"type": "input.done"})
        assert events(await read_until_done(ws)) == [{"type": "session.done", "total_sentences": 0}]
        await send_turn(ws, "One sentence here. Ano", "ther one follows.")
        items = await read_until_done(ws)
    kinds = ["audio" if isinstance(i, bytes) else i["type"] for i in items]
    first_done = kinds.index("audio.done")
    assert kinds[0] == "audio.start" and kinds[-1] == "session.done"
    assert set(kinds[1:first_done]) == {"audio"}
    assert kinds[first_done + 1] == "audio.start"
    assert set(kinds[first_done + 2:-2]) == {"audio"} and kinds[-2] == "audio.done"
    starts = [e for e in events(items) if e["type"] == "audio.start"]
    assert [(e["sentence_index"], e["sentence_text"], e["format"], e["sample_rate"])
            for e in starts] == [(0, "One sentence here.", "pcm", 24000),
                                 (1, "Another one follows.", "pcm", 24000)]
    dones = [e for e in events(items) if e["type"] == "audio.done"]
    first, second = sentence_pcm(items)
    assert dones == [
        {"type": "audio.done", "sentence_index": 0, "total_bytes": len(first), "error": False},
        {"type": "audio.done", "sentence_index": 1, "total_bytes": len(second), "error": False}]
    assert items[-1] == {"type": "session.done", "total_sentences": 2}
    assert first == await reference_pcm(endless_service, "One sentence here.", 3, 12)
    assert second == await reference_pcm(endless_service, "Another one follows.", 3, 12)


GARBAGE = [
    pytest.param(b"\x00\x01garbage", 1003, "binary messages", id="binary"),
    pytest.param("{oops", 1007, "not valid JSON", id="broken-json"),
    pytest.param("[1, 2]", 1007, "JSON objects", id="json-array"),
    pytest.param('{"type": "dance"}', 1008, "valid types: ", id="unknown-type"),
    pytest.param('{"type": "input.text", "text": 5}', 1007, "string 'text'", id="text-not-string"),
]


@pytest.mark.parametrize("garbage, code, message", GARBAGE)
async def test_garbage_gets_an_error_event_and_a_close_and_the_server_goes_on(server, garbage,
                                                                             code, message):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws_url) as ws:
        await ws.send_json(CONFIG)
        if isinstance(garbage, bytes):
            await ws.send_bytes(garbage)
        else:
            await ws.send_str(garbage)
        items = await read_until_done(ws)
    (error,) = events(items)
    assert error["type"] == "error" and error["code"] == "protocol_error"
    assert message in error["message"]
    assert items[-1] == ("closed", code)
    await still_serves(server.ws_url)


async def test_text_before_session_config_is_refused(server):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws_url) as ws:
        await ws.send_json({"type": "input.text", "text": "Hello."})
        items = await read_until_done(ws)
    assert "send session.config before input.text" in events(items)[0]["message"]
    assert items[-1] == ("closed", 1008)


@pytest.mark.parametrize("how", ["disconnect", "garbage"])
async def test_socket_that_leaves_mid_stream_frees_its_engine_session(server, endless_service,
                                                                      how):
    before = endless_service.streams_opened
    registry = server.ctx.metrics.registry

    def outcomes() -> dict[str, float]:
        return {o: registry.get_sample_value("qwen_tts_streams_total", {"endpoint": "ws", "outcome": o}) or 0
                for o in ("completed", "cancelled", "failed")}

    counted = outcomes()
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws_url) as ws:
        await ws.send_json({**CONFIG, "max_new_tokens": 400})
        await ws.send_json({"type": "input.text", "text": LONG_TEXT})
        await ws.send_json({"type": "input.done"})
        for _ in range(MAX_MESSAGES):  # up to the first audio
            msg = await ws.receive(timeout=TIMEOUT)
            if msg.type is aiohttp.WSMsgType.BINARY:
                break
        if how == "garbage":
            await ws.send_str("{garbage")
            items = await read_until_done(ws)
            assert items[-1] == ("closed", 1007)
            assert any(e["type"] == "error" for e in events(items))
    await eventually(lambda: settled(server) and endless_service.records_since(before),
               what="the stream to be freed")
    (record,) = endless_service.records_since(before)
    assert record.stop_reason == "cancelled" and record.frames_decoded < 400
    # /metrics: the client left (or broke the protocol); the engine did not fail.
    await eventually(lambda: sum(outcomes().values()) > sum(counted.values()), what="the stream to be counted")
    now = outcomes()
    assert {o: now[o] - counted[o] for o in now} == {"completed": 0, "cancelled": 1, "failed": 0}


BAD_CONFIGS = [
    pytest.param({"voice": "nobody"}, "valid voices: ", id="unknown-voice"),
    pytest.param({"volume": 3}, "unknown field(s) in session.config", id="unknown-field"),
    pytest.param({"speed": 2.0}, "'speed' must be 1.0", id="speed"),
    pytest.param({"task_type": "Base"}, "a CustomVoice model", id="task-type"),
    pytest.param({"response_format": "wav"}, "valid choices: pcm", id="format"),
    pytest.param({"stream_audio": False}, "stream_audio=false", id="stream-audio"),
    pytest.param({"streaming_mode": "token"}, "valid choices: sentence", id="streaming-mode"),
    pytest.param({"word_timestamps": True}, "word timestamps", id="word-timestamps"),
    pytest.param({"timestamp_type": "word"}, "word timestamps", id="timestamp-type"),
    pytest.param({"ref_audio": "UklGRg=="}, "voice cloning (ref_audio) needs a Base model",
                 id="ref-audio"),
    pytest.param({"speaker_embedding": [0.5]}, "speaker_embedding is not supported",
                 id="speaker-embedding"),
    pytest.param({"initial_codec_chunk_frames": 0}, "between 1 and 32", id="chunk-frames"),
    pytest.param({"chunk_frames": 33}, "between 1 and 32", id="later-chunk-frames"),
    pytest.param({"chunk_growth": 0}, "between 1 and 32", id="chunk-growth"),
    pytest.param({"greedy": "yes"}, "'greedy' must be true or false", id="greedy"),
    pytest.param({"max_new_tokens": "ten"}, "'max_new_tokens' must be an integer", id="tokens"),
    pytest.param({"language": "klingon"}, "valid languages", id="language"),
]


@pytest.mark.parametrize("change, message", BAD_CONFIGS)
async def test_bad_session_config_is_an_error_event_and_the_socket_stays_open(server, change,
                                                                             message):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws_url) as ws:
        await ws.send_json({**CONFIG, **change})
        error = json.loads((await ws.receive(timeout=TIMEOUT)).data)
        assert error["type"] == "error" and message in error["message"]
        await ws.send_json(CONFIG)
        await ws.send_json({"type": "input.text", "text": "Fine now."})
        await ws.send_json({"type": "input.done"})
        items = await read_until_done(ws)
    assert items[-1] == {"type": "session.done", "total_sentences": 1}
    assert sum(len(i) for i in items if isinstance(i, bytes)) == 12 * FRAME_SAMPLES * 2


async def test_api_key_is_checked_at_the_handshake(endless_service, endless_path):
    with running(settings_for(endless_path, api_key="sekret"), endless_service) as srv:
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Api-Key wrong"}):
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await http.ws_connect(srv.ws_url, headers=headers)
                assert refused.value.status in (401, 403)
        for scheme in ("Api-Key", "Bearer"):
            await still_serves(srv.ws_url, {"Authorization": f"{scheme} sekret"})


async def test_full_server_answers_a_turn_with_an_error_event_then_serves_the_next(
        endless_service, endless_path):
    with running(settings_for(endless_path, max_streams=1, max_frames=12), endless_service) as srv:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            async with client.stream("POST", srv.base_url + "/v1/audio/speech", json={
                    "input": LONG_TEXT, "voice": VOICE, "response_format": "pcm",
                    "max_new_tokens": 12}) as holding:
                pieces = holding.aiter_raw()
                await anext(pieces)  # holds the only slot
                async with aiohttp.ClientSession() as http, http.ws_connect(srv.ws_url) as ws:
                    await ws.send_json(CONFIG)
                    await ws.send_json({"type": "input.text", "text": "Am I too late?"})
                    await ws.send_json({"type": "input.done"})
                    items = await read_until_done(ws)
                    assert items[0]["type"] == "error" and items[0]["code"] == "overloaded"
                    assert items[-1] == {"type": "session.done", "total_sentences": 0}
                    async for _ in pieces:  # the HTTP stream ends and frees its slot
                        pass
                    await eventually(lambda: settled(srv), what="the slot")
                    await ws.send_json({"type": "input.text", "text": "Now?"})
                    await ws.send_json({"type": "input.done"})
                    items = await read_until_done(ws)
        assert items[-1] == {"type": "session.done", "total_sentences": 1}
        assert not [e for e in events(items) if e["type"] == "error"]


async def test_turn_over_the_input_bound_is_cut_short_and_the_socket_goes_on(endless_service,
                                                                            endless_path):
    with running(settings_for(endless_path, max_input_chars=100), endless_service) as srv:
        async with aiohttp.ClientSession() as http, http.ws_connect(srv.ws_url) as ws:
            await ws.send_json(CONFIG)
            for _ in range(3):  # 120 characters and no sentence end: nothing can be spoken yet
                await ws.send_json({"type": "input.text",
                                    "text": "forty characters without an ending here "})
            await ws.send_json({"type": "input.done"})
            items = await read_until_done(ws)
            assert events(items)[0]["code"] == "input_too_long"
            assert "over 100 characters" in events(items)[0]["message"]
            assert items[-1]["type"] == "session.done"
            assert not [i for i in items if isinstance(i, bytes)]
            await ws.send_json({"type": "input.text", "text": "Short."})
            await ws.send_json({"type": "input.done"})
            assert (await read_until_done(ws))[-1] == {"type": "session.done",
                                                       "total_sentences": 1}
        await eventually(lambda: settled(srv), what="the slot")


async def test_idle_socket_is_closed_after_the_idle_timeout(endless_service, endless_path):
    with running(settings_for(endless_path, ws_idle_timeout_s=0.5, ws_config_timeout_s=0.5),
                 endless_service) as srv:
        async with aiohttp.ClientSession() as http:
            for first in (None, CONFIG):  # no session.config at all, then no message after it
                async with http.ws_connect(srv.ws_url) as ws:
                    if first is not None:
                        await ws.send_json(first)
                    items = await read_until_done(ws, within=10)
                assert events(items)[0]["code"] == "timeout"
                assert items[-1] == ("closed", 1000)


async def test_clients_gone_as_their_refused_turns_end_leave_no_slot(endless_service, endless_path,
                                                                      caplog):
    """Turns the engine refuses (admission by round time), each client hanging up on the refusal:
    the server sends session.done into a closing socket, and the turns' slots still
    come back (an H200 fleet run ended with 129 slots held by such turns)."""
    # Long enough to outlast the 20 refusals on a loaded 2-core machine (the full suite once saw
    # a turn admitted: the held stream had ended, and with no live stream nothing is refused).
    held = endless_service.open_stream(SynthesisRequest(" ".join([LONG_TEXT] * 4), voice=VOICE,
                                                        max_frames=2000))
    saved = endless_service._max_round_ms
    try:
        # Live before the first turn: a stream still waiting to open does not make the engine
        # refuse (admission's rules hold while streams are live), and the shared service's
        # round time is already > 0 from earlier tests (the full suite once saw a turn admitted).
        await eventually(lambda: held.record.opened and endless_service.round_ms > 0,
                         what="the held stream live")
        endless_service._max_round_ms = 1e-6  # any round is too long: every new stream is refused
        before = endless_service.refusals.get("max_round_ms", 0)
        with running(settings_for(endless_path, max_frames=12), endless_service) as srv:
            async with aiohttp.ClientSession() as http:
                for _ in range(20):
                    # Dual-track: the refusal is told as the text arrives, session.done follows
                    # from the speaker's side; the client hangs up between the two.
                    async with http.ws_connect(srv.ws_url) as ws:
                        await ws.send_json({**CONFIG, "non_streaming_mode": False})
                        await ws.send_json({"type": "input.text", "text": "Refused, then gone."})
                        await ws.send_json({"type": "input.done"})
                        msg = await ws.receive(timeout=TIMEOUT)
                        assert json.loads(msg.data)["code"] == "overloaded"
            await eventually(lambda: srv.ctx.gate.in_use == 0, what="the refused turns' slots")
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=TIMEOUT) as http:
                metrics = (await http.get("/metrics")).text
        # Each counted by the engine setting that refused it, as bench fleet reads it per level.
        assert f'qwen_tts_engine_refusals_total{{reason="max_round_ms"}} {before + 20.0}' in metrics
        by_reason = labelled(parse_metrics(metrics), "qwen_tts_engine_refusals_total", "reason")
        assert count_delta({"max_round_ms": before}, by_reason) == {"max_round_ms": 20}
        # Refusals are counted on /metrics, not warned of one by one: at twice an H200's capacity
        # they come by thousands a minute.
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "failed" in r.getMessage()]
    finally:
        endless_service._max_round_ms = saved
        await held.aclose()

"""WebSocket turns in dual-track mode: one engine streaming-text session per turn, fed piece by
piece as input.text arrives, framed as the protocol's sentence 0, with word times in audio.done;
LiveKit's Qwen3TTS client with word_timestamps; a socket closed mid-turn cancels the session."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from pipecat_qwen_fast import SynthesisRequest

from .conftest import FRAME_SAMPLES, VOICE, eventually, settled
from .test_ws import CONFIG, LONG_TEXT, TIMEOUT, events, read_until_done

pytestmark = pytest.mark.timeout(180)

STREAMED = {**CONFIG, "non_streaming_mode": False}
PIECES = ["You said hel", "lo. That", " is inter", "esting!"]
TEXT = "".join(PIECES)
FRAMES = 12


async def speak_pieces(url: str, transport: str) -> list:
    """One streamed turn of PIECES, 20 ms apart, with word times sent by `transport`."""
    config = {**STREAMED, "seed": 3, "max_new_tokens": FRAMES, "timestamp_type": "word",
              "timestamp_transport_strategy": transport}
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        await ws.send_json(config)
        for piece in PIECES:
            await ws.send_json({"type": "input.text", "text": piece})
            await asyncio.sleep(0.02)
        await ws.send_json({"type": "input.done"})
        return await read_until_done(ws)


async def test_turn_is_one_session_fed_as_text_arrives_with_word_times(server, endless_service):
    before = endless_service.streams_opened
    items = await speak_pieces(server.ws_url, "sync")
    kinds = [e["type"] for e in events(items)]
    assert kinds == ["audio.start", "audio.done", "session.done"], events(items)
    start, done, session_done = events(items)
    assert start["sentence_index"] == 0 and start["sample_rate"] == 24000
    assert (done["sentence_index"], done["error"], done["sentence_text"]) == (0, False, TEXT)
    assert session_done == {"type": "session.done", "total_sentences": 1}
    audio = b"".join(i for i in items if isinstance(i, bytes))
    assert done["total_bytes"] == len(audio) == FRAMES * FRAME_SAMPLES * 2

    # One engine session for the whole turn, and the whole text's audio in dual-track mode.
    await eventually(lambda: len(endless_service.records_since(before)) == 1, what="the record")
    await asyncio.sleep(0.2)
    (record,) = endless_service.records_since(before)
    assert record.stop_reason == "frame_cap" and record.frames_decoded == FRAMES
    whole = await asyncio.wait_for(endless_service.synthesize(SynthesisRequest(
        TEXT, voice=VOICE, seed=3, max_frames=FRAMES, text_mode="dual_track")), TIMEOUT)
    got = np.frombuffer(audio, "<i2").astype(np.int32)
    assert len(got) == len(whole) and np.abs(got - whole).max() <= 1

    # Words read within the audio, at frame times, each ending where the next begins.
    align = done["timestamp_info"]["word_alignment"]
    words, starts, ends = (align["words"], align["word_start_times_seconds"],
                           align["word_end_times_seconds"])
    assert words == TEXT.split()  # all read within the 12 frames
    assert starts[0] == 0.0 and starts == sorted(starts) and starts[-1] < FRAMES * 0.08
    assert all(s == pytest.approx(round(s / 0.08) * 0.08) for s in starts)
    assert ends == [*starts[1:], pytest.approx(FRAMES * 0.08)]
    await eventually(lambda: settled(server), what="the turn to be released")


async def test_async_word_times_come_before_the_audio_that_reads_them(server):
    """timestamp_transport_strategy "async": an audio.timestamps event before each piece of audio
    names the words its frames read (what the remote adapters' streamed turns use)."""
    items = await speak_pieces(server.ws_url, "async")
    kinds = [e["type"] for e in events(items)]
    assert kinds[0] == "audio.start" and kinds[-2:] == ["audio.done", "session.done"]
    assert set(kinds[1:-2]) == {"audio.timestamps"}
    assert "timestamp_info" not in events(items)[-2]
    words, starts, ends, spaces = [], [], [], []
    samples = 0  # audio received before each event
    for i, item in enumerate(items):
        if isinstance(item, bytes):
            samples += len(item) // 2
        elif item["type"] == "audio.timestamps":
            assert isinstance(items[i + 1], bytes)  # the audio that reads these words comes next
            heard_by = (samples + len(items[i + 1]) // 2) / 24000
            align = item["word_alignment"]
            # Words the audio sent before this event read were named in an earlier one.
            assert item["sentence_index"] == 0 and all(samples / 24000 <= s + 1e-6
                                                       for s in align["word_start_times_seconds"])
            assert all(s < heard_by for s in align["word_start_times_seconds"])
            words += align["words"]
            starts += align["word_start_times_seconds"]
            ends += align["word_end_times_seconds"]
            spaces += align["word_space_before"]
    assert words == TEXT.split() and spaces == [False] + [True] * (len(words) - 1)
    assert starts[0] == 0.0 and starts == sorted(starts)
    assert all(s == pytest.approx(round(s / 0.08) * 0.08) for s in starts)
    assert all(s <= e for s, e in zip(starts, ends, strict=True))
    assert samples == FRAMES * FRAME_SAMPLES


@pytest.mark.parametrize("schedule, sizes", [
    ({"chunk_frames": 2, "max_chunk_frames": 4, "chunk_growth": 2}, [1, 2, 4, 4, 1]),
    ({"chunk_frames": 1, "chunk_growth": 3}, [1, 1, 4, 6]),  # each chunk at most 3x the frames sent
])
async def test_extension_options_reach_the_engine(server, endless_service, schedule, sizes):
    """The remote adapters' options beyond vLLM-Omni's fields: greedy and the chunk schedule."""
    text = "Greedy words, in small chunks."
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws_url) as ws:
        await ws.send_json({**CONFIG, "greedy": True, **schedule})
        await ws.send_json({"type": "input.text", "text": text})
        await ws.send_json({"type": "input.done"})
        items = await read_until_done(ws)
    audio = [i for i in items if isinstance(i, bytes)]
    assert [len(a) // 2 // FRAME_SAMPLES for a in audio] == sizes
    whole = await asyncio.wait_for(endless_service.synthesize(SynthesisRequest(
        text, voice=VOICE, greedy=True, max_frames=12, **schedule)),
        TIMEOUT)
    assert b"".join(audio) == whole.astype("<i2").tobytes()


async def test_livekit_qwen3tts_client_gets_the_word_times_as_its_aligned_transcript(
        server, endless_service):
    from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
    from livekit.plugins import baseten

    before = endless_service.streams_opened
    async with aiohttp.ClientSession() as http:
        tts = baseten.TTS(model="qwen3-tts", model_endpoint=server.ws_url, api_key="unused",
                          voice=VOICE, task_type="CustomVoice", max_new_tokens=FRAMES,
                          word_timestamps=True, extra_config={"non_streaming_mode": False},
                          http_session=http)
        try:
            stream = tts.stream()
            for piece in PIECES:
                stream.push_text(piece)
            stream.end_input()
            got = [ev async for ev in stream]
            await stream.aclose()
        finally:
            await tts.aclose()
    samples = sum(ev.frame.samples_per_channel for ev in got)
    assert samples in (FRAMES * FRAME_SAMPLES, FRAMES * FRAME_SAMPLES + 240)
    timed = [t for ev in got for t in ev.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
    assert "".join(timed) == TEXT + " "  # the client spaces each word
    assert timed[0].start_time == 0.0
    await eventually(lambda: len(endless_service.records_since(before)) == 1, what="the record")
    assert endless_service.records_since(before)[0].frames_decoded == FRAMES


@pytest.mark.parametrize("ended", [False, True], ids=["text-still-coming", "after-input-done"])
async def test_socket_closed_mid_turn_cancels_the_engine_session(server, endless_service, ended):
    before = endless_service.streams_opened
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(server.ws_url)
        await ws.send_json({**STREAMED, "max_new_tokens": None})
        await ws.send_json({"type": "input.text", "text": LONG_TEXT})
        if ended:
            await ws.send_json({"type": "input.done"})
        for _ in range(20):
            msg = await ws.receive(timeout=TIMEOUT)
            if msg.type is aiohttp.WSMsgType.BINARY:
                break
        assert msg.type is aiohttp.WSMsgType.BINARY
        await ws.close()
    await eventually(lambda: len(endless_service.records_since(before)) == 1, what="the record")
    (record,) = endless_service.records_since(before)
    assert record.stop_reason == "cancelled"
    await eventually(lambda: settled(server), what="the turn to be released")


@pytest.mark.parametrize(("change", "param"), [
    ({"word_timestamps": True, "non_streaming_mode": True}, "word_timestamps"),
    ({"timestamp_type": "word"}, "word_timestamps"),  # CustomVoice's default is prefill
    ({**STREAMED, "timestamp_type": "phoneme"}, "timestamp_type"),
    ({**STREAMED, "timestamp_type": "word", "timestamp_transport_strategy": "batched"},
     "timestamp_transport_strategy"),
])
async def test_word_timestamps_only_on_streamed_turns(server, change, param):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws_url) as ws:
        await ws.send_json({**CONFIG, **change})
        msg = await ws.receive_json(timeout=TIMEOUT)
        assert msg["type"] == "error" and param.split("_")[0] in msg["message"]
        await ws.send_json({"type": "input.done"})
        assert events(await read_until_done(ws))[-1] == {"type": "session.done",
                                                          "total_sentences": 0}

"""Streamed-text turns on the EngineService (engine/text_service.py): the text appended from the
event loop as it arrives, the engine thread skipping a turn that waits (no decoding, no spinning),
idle timeout, cancel, empty turns, and the whole text's codes."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest
import torch

from pipecat_qwen_fast import EngineService, InvalidInputError, QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.engine.text_service import TextStream
from pipecat_qwen_fast.engine.text_stream import TextEndedError

TIMEOUT = 120
CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
DEVICES = [
    pytest.param(CPU, id="cpu"),
    pytest.param(
        {"device": "cuda", "dtype": "bfloat16", "backend": "torch"},
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@pytest.fixture
def service_for(finite_model):
    made: list[EngineService] = []

    def make(placement=CPU) -> EngineService:
        engine = QwenTTSEngine.from_pretrained(finite_model, progress=False, **placement)
        service = EngineService.for_engine(engine)
        made.append(service)
        return service

    yield make
    for service in made:
        service.close()


async def collect(stream) -> list:
    return [chunk async for chunk in stream]


async def feed(stream: TextStream, parts: list[str], rng: random.Random, end: bool = True) -> None:
    for part in parts:
        stream.append(part)
        await asyncio.sleep(rng.uniform(0, 0.03))
    if end:
        stream.end()


def codes_of(chunks) -> np.ndarray:
    return np.concatenate([c.codes for c in chunks]) if chunks else np.zeros((0, 16), np.int64)


@pytest.mark.parametrize("placement", DEVICES)
async def test_streamed_turn_equals_the_whole_text(service_for, placement):
    service = service_for(placement)
    await asyncio.wait_for(service.wait_ready(), 600)
    rng = random.Random(0)
    text = "Hello there, this turn arrives token by token. Then it ends!"
    kw = {"voice": "ryan", "seed": 4, "max_frames": 30}
    whole = await asyncio.wait_for(
        collect(service.open_stream(SynthesisRequest(text, text_mode="dual_track", **kw))), TIMEOUT
    )
    tokens = [text[i : i + 4] for i in range(0, len(text), 4)]  # LLM-sized pieces
    stream = service.open_text_stream(SynthesisRequest("", **kw))
    got, _ = await asyncio.wait_for(
        asyncio.gather(collect(stream), feed(stream, tokens, rng)), TIMEOUT
    )
    assert np.array_equal(codes_of(got), codes_of(whole))
    assert stream.record.closed and stream.record.error is None and stream.ended_by == "end"
    assert [w.text for w in stream.words()][:3] == ["Hello", "there,", "this"]


async def test_waiting_turn_neither_decodes_nor_spins(service_for):
    service = service_for()
    await asyncio.wait_for(service.wait_ready(), TIMEOUT)
    stream = service.open_text_stream(SynthesisRequest("", voice="ryan", seed=1, max_frames=20))
    stream.append("Wait for the rest of this")
    deadline = time.monotonic() + TIMEOUT
    while stream.record.frames_decoded < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    steps, cpu = service.steps_run, time.process_time()
    await asyncio.sleep(0.5)
    assert service.steps_run == steps, "frames were decoded for a turn with no text to read"
    assert time.process_time() - cpu < 0.15, "the engine thread spins while the turn waits"
    # A whole-text stream goes on meanwhile.
    other = await asyncio.wait_for(
        collect(
            service.open_stream(SynthesisRequest("Meanwhile.", voice="aiden", seed=2, max_frames=5))
        ),
        TIMEOUT,
    )
    assert sum(c.num_frames for c in other) == 5
    stream.append(" sentence.")
    stream.end()
    chunks = await asyncio.wait_for(collect(stream), TIMEOUT)
    assert stream.record.frames_decoded == sum(c.num_frames for c in chunks) > 3


async def test_idle_timeout_ends_and_frees_the_turn(service_for):
    service = service_for()
    await asyncio.wait_for(service.wait_ready(), TIMEOUT)
    stream = service.open_text_stream(
        SynthesisRequest("", voice="ryan", seed=1, max_frames=60), idle_timeout_s=0.3
    )
    stream.append("Nobody ends this turn")
    chunks = await asyncio.wait_for(collect(stream), TIMEOUT)
    record = await asyncio.wait_for(stream.wait_closed(), TIMEOUT)
    assert stream.ended_by == "idle_timeout" and record.error is None and chunks
    with pytest.raises(TextEndedError, match="idle timeout"):
        stream.append(" late")


async def test_cancel_empty_and_bad_turns(service_for):
    service = service_for()
    await asyncio.wait_for(service.wait_ready(), TIMEOUT)
    # Barge-in: cancel mid-turn; the session goes within a frame, later text is dropped.
    stream = service.open_text_stream(SynthesisRequest("", voice="ryan", seed=1, max_frames=400))
    stream.append("Keep talking for a while, there is a lot to say here. " * 3)
    async for _ in stream:
        break
    record = await asyncio.wait_for(stream.aclose(), TIMEOUT)
    assert (
        record.stop_reason == "cancelled" and record.frames_decoded - record.frames_at_cancel <= 1
    )
    stream.append("dropped")
    # What was read by then: a word per frame at most, from the start of the text.
    spoken = stream.spoken_text(10.0)
    assert spoken and "Keep talking for a while, there".startswith(spoken)
    assert len(stream.words()) <= record.frames_decoded

    # Empty turns: no audio, no error.
    for text in ("", "   "):
        stream = service.open_text_stream(SynthesisRequest("", voice="ryan"))
        stream.append(text)
        stream.end()
        assert await asyncio.wait_for(collect(stream), TIMEOUT) == []
        assert stream.record.error is None and stream.record.stop_reason == "empty"

    # After end(): a clear error. A bad request: its error from the iteration, as for any stream.
    stream = service.open_text_stream(SynthesisRequest("", voice="ryan", max_frames=3))
    stream.append("Done.")
    stream.end()
    with pytest.raises(TextEndedError, match="after end"):
        stream.append("More.")
    assert await asyncio.wait_for(collect(stream), TIMEOUT)
    bad = service.open_text_stream(SynthesisRequest("", voice="nobody"))
    bad.append("Hello there.")
    with pytest.raises(InvalidInputError, match="nobody"):
        await asyncio.wait_for(collect(bad), TIMEOUT)
    with pytest.raises(InvalidInputError, match="dual_track"):
        await asyncio.wait_for(
            collect(
                service.open_text_stream(SynthesisRequest("", voice="ryan", text_mode="prefill"))
            ),
            TIMEOUT,
        )

"""Opens prepared while a round decodes (EngineService(prepare_opens=True), issue 34): the next
round's calls are validated and their prompts built during the batched frame's GPU wait. The calls
speak exactly as when prepared at their open, a prepared call's bad input reaches its caller alone,
a call prepared, then cancelled or sent back to wait for a slot, leaves nothing behind, and
streamed-text turns queued with their text begin from the prompt built ahead and speak as turns
whose prompt was built at their begin. Real engine on a batched backend (GraphBackend without
graphs), tiny checkpoint, CPU."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from helpers_service import open_staggered

from pipecat_qwen_fast import InvalidInputError, QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.backends.graph import GraphBackend
from pipecat_qwen_fast.engine.service import EngineService

TIMEOUT = 120


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    e = QwenTTSEngine.from_pretrained(tiny_checkpoint("custom_voice", zero_eos=True), device="cpu",
                                      dtype="float32", backend="eager", progress=False)
    e.backend = GraphBackend(e.model.talker, e.device, e.dtype, max_sessions=3, capacity=512, use_graphs=False)
    return e


def request(i: int, frames: int = 6, **kw) -> SynthesisRequest:
    return SynthesisRequest(f"Caller number {i} says hello.", voice="ryan", seed=i, max_frames=frames,
                            greedy=True, first_chunk_frames=1, chunk_frames=2, **kw)


async def run(engine, requests, prepare: bool, **kw) -> tuple[list, int]:
    before = engine.prepared_opens
    async with EngineService.for_engine(engine, prepare_opens=prepare, **kw) as service:
        await service.wait_ready()
        out = await open_staggered(service, requests, TIMEOUT)
    return out, engine.prepared_opens - before


async def test_prepared_opens_speak_as_opens_prepared_at_their_open(engine):
    # Three slots for six calls: later calls also wait for a slot (prepared, sent back, prepared again).
    requests = [request(i, frames=4 + i % 3) for i in range(6)]
    on, prepared = await run(engine, requests, prepare=True)
    off, unprepared = await run(engine, requests, prepare=False)
    assert prepared > 0, "no open was prepared during a round"
    assert unprepared == 0
    for i, (a, b) in enumerate(zip(on, off)):
        assert not isinstance(a, Exception) and not isinstance(b, Exception), (i, a, b)
        codes_a, codes_b = (np.concatenate([c.codes for c in x]) for x in (a, b))
        assert codes_a.shape == (requests[i].max_frames, 16)
        np.testing.assert_array_equal(codes_a, codes_b, err_msg=f"call {i}'s codes")
        pcm_a, pcm_b = (np.concatenate([c.pcm for c in x]).astype(np.int32) for x in (a, b))
        assert np.abs(pcm_a - pcm_b).max() <= 1, f"call {i}'s audio"  # batched vocoder calls: an LSB
    assert len(engine.backend.free_slots) == 3


async def test_a_prepared_calls_bad_input_reaches_that_caller_alone(engine):
    bad = SynthesisRequest("Caller with a voice nobody has.", voice="nobody", seed=7, max_frames=4)
    requests = [request(0, frames=10), request(1, frames=10), bad, request(3, frames=4)]
    out, prepared = await run(engine, requests, prepare=True)
    assert prepared > 0
    assert isinstance(out[2], InvalidInputError) and "nobody" in str(out[2]) and "ryan" in str(out[2])
    for i in (0, 1, 3):
        assert not isinstance(out[i], Exception), out[i]
        assert sum(c.num_frames for c in out[i]) == requests[i].max_frames
    assert len(engine.backend.free_slots) == 3


async def test_a_prepared_call_cancelled_before_its_open_leaves_nothing(engine):
    async with EngineService.for_engine(engine, prepare_opens=True, max_opens_per_round=1) as service:
        await service.wait_ready()
        caught = []
        prepare = service._prepare_opens

        def prepare_then_cancel():
            # On the engine thread, between the preparation and the round that would open them.
            prepare()
            for stream in late:
                if stream.prepared is not None and stream.session is None and not stream.cancel_requested:
                    caught.append(stream)
                    stream.cancel()

        late = []
        service._prepare_opens = prepare_then_cancel
        long = [service.open_stream(request(i, frames=30)) for i in range(2)]
        async for _ in long[0]:
            break
        # One open a round: of three calls queued together at least two wait through a round.
        late += [service.open_stream(request(10 + k, frames=4)) for k in range(3)]
        await asyncio.wait_for(asyncio.gather(*(s.wait_closed() for s in late)), TIMEOUT)
        assert caught, "no call was caught prepared and not yet opened"
        for s in caught:
            assert s.record.stop_reason == "cancelled" and not s.record.opened
        for s in long:
            s.cancel()
            await asyncio.wait_for(s.wait_closed(), TIMEOUT)
        assert service.admitted_streams == 0
    assert len(engine.backend.free_slots) == 3

async def turns(service: EngineService, requests: list[SynthesisRequest]) -> list:
    """Streamed-text turns, each opened with its whole text (as the server's WebSocket callers
    send it) once the one before has its first chunk; each turn's chunks."""

    async def read(stream, first: asyncio.Event):
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            first.set()
        first.set()
        return chunks

    tasks = []
    for r in requests:
        stream = service.open_text_stream(dataclasses.replace(r, text=""))
        stream.append(r.text)
        stream.end()
        first = asyncio.Event()
        tasks.append(asyncio.create_task(read(stream, first)))
        await asyncio.wait_for(first.wait(), TIMEOUT)
    return await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)


async def test_prepared_streamed_turns_speak_as_turns_prepared_at_their_begin(engine):
    requests = [dataclasses.replace(request(i, frames=5 + i % 3), text_mode="dual_track") for i in range(6)]
    out = {}
    for prepare in (True, False):
        before = engine.prepared_begins
        async with EngineService.for_engine(engine, prepare_opens=prepare) as service:
            await service.wait_ready()
            out[prepare] = await turns(service, requests)
        out[prepare, "begins"] = engine.prepared_begins - before
    assert out[True, "begins"] > 0, "no turn began from a prompt built ahead"
    assert out[False, "begins"] == 0
    for i, (a, b) in enumerate(zip(out[True], out[False])):
        codes_a, codes_b = (np.concatenate([c.codes for c in x]) for x in (a, b))
        assert codes_a.shape == (requests[i].max_frames, 16)
        np.testing.assert_array_equal(codes_a, codes_b, err_msg=f"turn {i}'s codes")
    assert len(engine.backend.free_slots) == 3

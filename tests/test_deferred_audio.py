"""A batched round's vocoder calls handed back as DeferredChunks and resolved a round later
(EngineService(overlap_vocoder=True), engine/deferred_audio.py): the same audio in the same order
as without, every chunk delivered, nothing left pending; on the tiny checkpoint's real engine on
CPU with the batch backend's frame run eagerly (no side stream here: the hand-back is what is
deferred). Whether the side stream overlaps on the GPU is bench/probes/batch_overlap.py's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from helpers_probes import cpu_batch_engine
from helpers_service import collect_all, open_together

from pipecat_qwen_fast import SynthesisRequest
from pipecat_qwen_fast.engine.deferred_audio import DeferredChunk, VocoderSide
from pipecat_qwen_fast.engine.request import AudioChunk
from pipecat_qwen_fast.engine.service import EngineService, SynthesisStream

TIMEOUT = 120


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    e = cpu_batch_engine(tiny_checkpoint("custom_voice", zero_eos=True), max_sessions=8)
    yield e
    e.close()


REQUESTS = [SynthesisRequest(text, voice=voice, seed=seed, max_frames=frames)
            for text, voice, seed, frames in (("First caller here.", "ryan", 1, 14), ("Second one.", "aiden", 2, 9),
                                              ("A third, longer sentence.", "serena", 3, 17))]


async def serve_all(engine, overlap: bool) -> list[list[AudioChunk]]:
    async with EngineService.for_engine(engine, overlap_vocoder=overlap, max_lead_s=None,
                                        max_round_ms=None) as service:
        await service.wait_ready()
        # The three arrive together, so both runs batch the same calls in the same rounds.
        return await collect_all(open_together(service, REQUESTS), TIMEOUT)


async def test_deferred_chunks_carry_the_same_audio_in_order(engine):
    side = engine.vocoder_side
    plain = await serve_all(engine, overlap=False)
    assert side.resolved_calls == 0, "no deferral unless asked"
    deferred = await serve_all(engine, overlap=True)
    assert side.resolved_calls > 0 and side.resolved_beside_a_frame > 0, (
        "chunks were deferred and resolved beside the next round's frame")
    assert not side.calls and not engine.defer_vocoder_audio  # the service turned it off again
    for got, want, request in zip(deferred, plain, REQUESTS):
        assert all(isinstance(c, AudioChunk) for c in got)
        assert [c.frame_index for c in got] == [c.frame_index for c in want]
        assert sum(c.num_frames for c in got) == request.max_frames
        for a, b in zip(got, want):
            assert np.array_equal(a.codes, b.codes)
            assert np.array_equal(a.pcm, b.pcm)
    assert len(engine.backend.free_slots) == 8


async def test_cancelling_while_chunks_are_deferred_leaves_nothing_behind(engine):
    async with EngineService.for_engine(engine, overlap_vocoder=True, max_lead_s=None, max_round_ms=None,
                                        max_buffered_chunks=2) as service:
        await service.wait_ready()
        streams = [service.open_stream(SynthesisRequest(f"Caller {i} speaks.", voice="ryan", seed=i,
                                                        max_frames=40)) for i in range(4)]
        first = [await asyncio.wait_for(s.__anext__(), TIMEOUT) for s in streams]
        assert all(isinstance(c, AudioChunk) and c.frame_index == 0 for c in first)
        await asyncio.wait_for(streams[0].aclose(), TIMEOUT)
        await asyncio.wait_for(streams[1].aclose(), TIMEOUT)
        rest = await collect_all(streams[2:], TIMEOUT)
        for c0, chunks in zip(first[2:], rest):
            assert c0.num_frames + sum(c.num_frames for c in chunks) == 40
    assert not engine.vocoder_side.calls
    assert len(engine.backend.free_slots) == 8


def test_vocoder_side_resolves_in_order_and_drops_on_failure():
    side = VocoderSide(torch.device("cpu"))
    told = []
    chunks = [DeferredChunk(0, 1, np.zeros((1, 16), np.int64)), DeferredChunk(4, 2, np.zeros((2, 16), np.int64))]
    for c in chunks:
        c.on_resolved = told.append
    pcm = torch.arange(2 * 2 * 1920, dtype=torch.int16).view(2, 2 * 1920)  # a call of 2 rows x 2 frames
    side.add(pcm, None, 2, [(0, chunks[0]), (1, chunks[1])], keep=())
    later = DeferredChunk(6, 2, np.zeros((2, 16), np.int64))
    side.add(pcm, None, 2, [(0, later)], keep=())
    assert side.resolve(1) == 1 and told == chunks and len(side.calls) == 1
    assert np.array_equal(chunks[0].chunk.pcm, pcm[0, :1920].numpy())  # its own frame of the padded row
    assert np.array_equal(chunks[1].chunk.pcm, pcm[1].numpy())
    side.drop()
    assert later.dropped and later.settled and later.chunk is None and not side.calls


async def test_a_reader_skips_a_dropped_chunk(engine):
    async with EngineService.for_engine(engine) as service:
        await service.wait_ready()
        stream = SynthesisStream(service, SynthesisRequest("Unused."), 0)  # not handed to the engine
        pending = DeferredChunk(0, 1, np.zeros((1, 16), np.int64))
        pending.on_resolved = stream._deferred_resolved
        stream._post(pending)
        real = AudioChunk(np.ones(1920, np.int16), 1, 1, np.zeros((1, 16), np.int64))
        stream._post(real)
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert not reader.done(), "a reader waits for a chunk whose audio is still being made"
        pending.drop()
        assert await asyncio.wait_for(reader, TIMEOUT) is real


async def test_deferred_chunks_count_their_slack_once_each(engine):
    # A margin no chunk meets: every chunk after a stream's first is low, deferred ones included.
    async with EngineService.for_engine(engine, overlap_vocoder=True, max_lead_s=None, max_round_ms=None,
                                        min_slack_ms=1e7) as service:
        await service.wait_ready()
        resolved = engine.vocoder_side.resolved_calls
        got = await collect_all(open_together(service, REQUESTS), TIMEOUT)
        assert engine.vocoder_side.resolved_calls > resolved  # some chunks were deferred
        assert service.low_slack_chunks == sum(len(chunks) - 1 for chunks in got)


async def test_a_deferred_chunks_slack_is_taken_when_its_audio_comes(engine):
    async with EngineService.for_engine(engine, min_slack_ms=1e7) as service:
        await service.wait_ready()
        stream = SynthesisStream(service, SynthesisRequest("Unused."), 0)  # not handed to the engine
        stream._audio_arrived(1)  # its first chunk: playback starts, no slack
        pending = DeferredChunk(1, 2, np.zeros((2, 16), np.int64))
        lost = DeferredChunk(3, 1, np.zeros((1, 16), np.int64))
        for chunk in (pending, lost):
            chunk.on_resolved = stream._deferred_resolved
            stream._post(chunk)
        assert service.low_slack_chunks == 0, "no audio yet, no slack"
        pending.resolve(torch.zeros(1, 2 * 1920, dtype=torch.int16), 0, 2)
        assert service.low_slack_chunks == 1
        lost.drop()  # no audio: nothing to measure
        assert service.low_slack_chunks == 1


async def test_a_deferred_chunk_wakes_its_reader_once_when_its_audio_is_there(engine):
    # Posting a chunk whose audio is still on the way wakes nobody (the reader could not take it);
    # its resolve does. So a stream's reader loop is woken about once a chunk, not twice.
    loop = asyncio.get_running_loop()
    wakes = []
    call_soon_threadsafe = loop.call_soon_threadsafe

    def counted(callback, *args, **kwargs):
        wakes.append(callback)
        return call_soon_threadsafe(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counted
    try:
        deferred = await serve_all(engine, overlap=True)
    finally:
        del loop.call_soon_threadsafe
    chunks = sum(len(chunks) for chunks in deferred)
    sets = [w for w in wakes if getattr(w, "__name__", "") == "set"]  # the streams' ready events
    assert engine.vocoder_side.resolved_calls > 0
    assert chunks <= len(sets) <= chunks + len(REQUESTS)  # one a chunk, and one at each stream's end

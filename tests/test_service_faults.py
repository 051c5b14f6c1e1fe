"""Faults end only what they touched, and no fault or closed consumer leaves a session or its K/V
state behind (issue 32, items 9, 10 and 11). Real engine, tiny random checkpoint, CPU; faults are
injected by wrapping a real engine or backend call, as tests/test_service.py does."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch
from helpers_faults import StateCount, fail_step_at

from pipecat_qwen_fast import QwenTTSEngine, SynthesisRequest
from pipecat_qwen_fast.engine.service import EngineService
from pipecat_qwen_fast.errors import EngineClosedError

CPU = {"device": "cpu", "dtype": "float32", "backend": "torch"}
TIMEOUT = 120
FAULTY = "Faulty request with a long text that makes its prompt longer than the others."


@pytest.fixture
def engine(endless_model):
    return QwenTTSEngine.from_pretrained(endless_model, progress=False, **CPU)


def request(text: str, seed: int, frames: int, **kw) -> SynthesisRequest:
    kw.setdefault("chunk_frames", 2)
    return SynthesisRequest(text, voice="ryan", seed=seed, max_frames=frames, greedy=True, first_chunk_frames=1, **kw)


def fail_prefill_of_long_prompts(engine, monkeypatch, longer_than: int) -> None:
    """One request's prefill fails (as one too long for the backend's capacity would)."""
    real = engine.backend.prefill

    def prefill(state, embeds):
        if embeds.shape[0] > longer_than:
            raise RuntimeError("injected prefill fault")
        return real(state, embeds)

    monkeypatch.setattr(engine.backend, "prefill", prefill)


# -- item 9 -------------------------------------------------------------------------------------


def test_one_failed_prefill_fails_only_its_own_request(engine, monkeypatch):
    good = [request(f"Caller number {i}.", i, 3) for i in range(7)]
    solo = [engine.generate_codes(r.text, voice="ryan", seed=r.seed, max_frames=3, greedy=True).numpy()
            for r in good]
    count = StateCount(engine.backend, monkeypatch)
    fail_prefill_of_long_prompts(engine, monkeypatch, longer_than=20)

    opened = engine.open_sessions(good[:3] + [request(FAULTY, 99, 3)] + good[3:])
    bad = opened.pop(3)
    assert isinstance(bad, RuntimeError) and "injected" in str(bad)
    assert all(not isinstance(s, Exception) for s in opened), opened
    for s, want in zip(opened, solo):
        while not s.done:
            engine.step(s)
        assert np.array_equal(np.stack(s.codes), want)
    assert not count.live


async def test_one_failed_prefill_in_a_round_fails_only_its_stream(engine, monkeypatch):
    service = EngineService.for_engine(engine)
    try:
        await service.wait_ready()
        fail_prefill_of_long_prompts(engine, monkeypatch, longer_than=20)
        rounds: list[int] = []
        real_open = engine.open_sessions

        def open_sessions(requests, **kwargs):
            rounds.append(len(requests))
            return real_open(requests, **kwargs)

        monkeypatch.setattr(engine, "open_sessions", open_sessions)
        # A stream holds the engine thread mid-frame, so the next eight arrive in one round.
        busy = service.open_stream(request("Busy for a while.", 1, 400, chunk_frames=1))
        await asyncio.wait_for(busy.__anext__(), TIMEOUT)
        streams = [service.open_stream(request(FAULTY if i == 5 else f"Caller {i}.", i, 3)) for i in range(8)]
        results = await asyncio.wait_for(
            asyncio.gather(*(_pcm(s) for s in streams), return_exceptions=True), TIMEOUT)
        busy.cancel()
        assert max(rounds) >= 2, rounds  # the faulty request shared its round
        assert isinstance(results[5], RuntimeError)
        assert all(isinstance(r, np.ndarray) and len(r) == 3 * 1920 for i, r in enumerate(results) if i != 5)
        assert service.alive
    finally:
        service.close()


# -- item 10 ------------------------------------------------------------------------------------


async def test_fatal_fault_closes_every_open_session(engine, monkeypatch):
    count = StateCount(engine.backend, monkeypatch)
    service = EngineService.for_engine(engine)
    await service.wait_ready()
    fail_step_at(engine, monkeypatch, 6)
    callers = [service.synthesize(request(f"Caller {i}.", i, 20)) for i in range(4)]
    results = await asyncio.wait_for(asyncio.gather(*callers, return_exceptions=True), TIMEOUT)
    assert all(isinstance(r, (EngineClosedError, torch.AcceleratorError)) for r in results), results
    await asyncio.wait_for(asyncio.to_thread(service._thread.join), TIMEOUT)
    assert not service.alive
    # The engine stays its owner's (for_engine): reused, it must not carry the dead sessions' K/V.
    assert not count.live, f"{len(count.live)} K/V states left allocated"


async def test_out_of_memory_in_a_batched_step_ends_its_requests_not_the_engine(engine, monkeypatch):
    count = StateCount(engine.backend, monkeypatch)
    service = EngineService.for_engine(engine)
    try:
        await service.wait_ready()
        real = engine.step_many
        failed: list[int] = []

        def step_many(sessions, **kwargs):
            if not failed and len(sessions) >= 2:
                failed.append(len(sessions))
                raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")
            return real(sessions, **kwargs)

        monkeypatch.setattr(engine, "step_many", step_many)
        streams = [service.open_stream(request(f"Caller {i}.", i, 6)) for i in range(4)]
        results = await asyncio.wait_for(
            asyncio.gather(*(_pcm(s) for s in streams), return_exceptions=True), TIMEOUT)
        assert failed
        ooms = [r for r in results if isinstance(r, torch.OutOfMemoryError)]
        assert len(ooms) == failed[0], results
        assert all(isinstance(r, np.ndarray) for r in results if not isinstance(r, Exception))
        assert service.alive
        pcm = await asyncio.wait_for(service.synthesize(request("After the fault.", 9, 2)), TIMEOUT)
        assert len(pcm) == 2 * 1920
        assert not count.live
    finally:
        service.close()


# -- item 11 ------------------------------------------------------------------------------------


async def test_paused_stream_of_a_closed_loop_releases_its_session(engine, monkeypatch):
    count = StateCount(engine.backend, monkeypatch)
    service = EngineService.for_engine(engine, max_buffered_chunks=2)
    try:
        await service.wait_ready()
        opened: list = []

        def consumer_that_goes_away() -> None:
            async def main() -> None:
                stream = service.open_stream(request("Nobody will read me.", 1, 400, chunk_frames=1))
                opened.append(stream)
                while stream.buffered < 2:  # the engine fills its buffer and pauses it
                    await asyncio.sleep(0.01)
            asyncio.run(main())  # returns with the loop closed and the stream never read or closed

        thread = threading.Thread(target=consumer_that_goes_away)
        thread.start()
        await asyncio.to_thread(thread.join, TIMEOUT)
        (stream,) = opened
        deadline = time.monotonic() + 10
        while not stream.done and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert stream.done, "the paused stream kept its session"
        assert stream.record.stop_reason == "cancelled"
        assert stream.record.frames_decoded <= 3
        assert not count.live
    finally:
        service.close()


async def _pcm(stream) -> np.ndarray:
    return np.concatenate([chunk.pcm async for chunk in stream])


async def test_closing_a_stream_that_already_ended_records_no_cancel(engine):
    """Found by the soak: a consumer that leaves after the engine has ended its stream (but before
    reading the end) recorded a cancel at frame 0 of a finished stream."""
    service = EngineService.for_engine(engine)
    try:
        await service.wait_ready()
        stream = service.open_stream(request("Short.", 1, 3, chunk_frames=1))
        await asyncio.wait_for(stream.__anext__(), TIMEOUT)
        await asyncio.wait_for(stream.wait_closed(), TIMEOUT)  # the engine has finished it
        record = await asyncio.wait_for(stream.aclose(), TIMEOUT)
        assert record.stop_reason == "frame_cap" and record.frames_decoded == 3
        assert record.frames_at_cancel is None
    finally:
        service.close()
